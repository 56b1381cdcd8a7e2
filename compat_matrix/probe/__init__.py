"""Probe one vLLM environment: does this project's patch (``cpu_fused_norms``)
apply and work there, and does the out-of-tree provider its ``patch.toml``
names? ``python -m compat_matrix.probe`` (see ``cli``). The provider module owns
its identity (``PROVIDER``, ``OPS``, ``OPT_IN_ENV``); the probe reads them.

Data flows one way: ``cli`` -> ``document`` (the JSON document) -> ``checks``
(the registry; one module per group of checks, on the shared ``framework``)
-> what they run: ``numerics``, ``children`` (work in a fresh interpreter
or a fork), ``vllm_ir``, ``provider_module``; ``facts`` holds the document's
facts about the environment.
"""
