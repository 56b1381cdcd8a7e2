"""Measurement: evidence for the change, measured on this machine.

``vllm-patch bench`` (``cli``) writes an evidence folder (``evidence``): vLLM's
serving benchmark and an accuracy comparison between the installed vLLM and a
patched copy (``serving`` over ``server``, ``accuracy``), the CPU kernels'
numerics per x86 build (``numerics``) and a per-call timing of vLLM's routes to
them (``perop``). ``engine_run`` makes the random-weight Llama and runs the
offline engine. Above ``patcher`` and ``patches``, below ``compat_matrix``,
which reuses the engine runner and the numerics."""
