"""Probe one vLLM environment: does this project's patch (``cpu_fused_norms``)
apply and work there, and does the out-of-tree provider its ``patch.toml``
names? ``python -m compat_matrix.probe`` (see ``cli``). The provider module owns
its identity (``PROVIDER``, ``OPS``, ``OPT_IN_ENV``); the probe reads them.

Data flows one way: ``cli`` -> ``document`` (the JSON document) -> ``checks``
(the registry; one module per group of checks, on the shared ``framework``)
-> what they run: ``vllm_patch.bench.numerics`` (the one comparison against native),
``dispatch_evidence``, ``child_tasks`` (work in a child process, via
``vllm_patch.runtime.child``), ``vllm_ir``, ``provider_module``.

A second opinion, on purpose: ``vllm_ir`` re-derives from vLLM itself what the
provider module also works out for its own use -- the norm ops and vLLM's
``vllm_c`` provider name, whether ``torch.ops._C`` has an op (``has_c_op``),
which ops this vLLM already enables ``vllm_c`` for (``upstream_enabled_ops``,
the provider's redundancy) and whether Inductor compiles
(``compiling_with_inductor``, vLLM's own rule). The probe does not import these
from the provider, so that a mistake there shows up as a failed check instead
of being repeated by the check; on every vLLM with IR the two agree.
``dispatch_evidence`` is the probe's own too: it counts which impl vLLM's
dispatch calls, where the numerics only judge the values.
"""
