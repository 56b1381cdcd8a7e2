"""Measurement: does a carried change pay off, and is it right, on this machine?

``vllm-patch bench`` (``cli``) times every vLLM IR implementation per op
(``perop``, checked first against native by ``numerics``) and vLLM end to end
on a random Llama (``e2e_step`` over ``engine_run``), in the installed vLLM and
in patched copies of it, and recommends an ``ir_op_priority`` from the figures
(``recommend``). ``reference/`` holds a reference result. Above ``patcher`` and
``patches``, below ``compat_matrix``, which reuses the engine runner and the
numerics."""
