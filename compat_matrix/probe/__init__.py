"""Probe one vLLM environment: does the CPU fused-norm provider work here, and
does the upstream patch? ``python -m compat_matrix.probe`` (see ``cli``).

Data flows one way: ``cli`` -> ``document`` (the JSON document) -> ``checks``
(one module per group of checks, on the shared ``framework``) -> the helpers
they run: ``numerics``, ``children`` (work in a fresh interpreter),
``vllm_ir``, ``provider_module``; ``environment`` holds the document's facts.
"""

from compat_matrix.probe.checks import CHECKS
from compat_matrix.probe.cli import main
from compat_matrix.probe.document import SCHEMA, run_probe
from compat_matrix.probe.framework import (
    DEFAULT_PROVIDER,
    PATCH_NAME,
    Fail,
    Probe,
    Skip,
)
from compat_matrix.probe.vllm_ir import vllm_config

__all__ = [
    "CHECKS",
    "DEFAULT_PROVIDER",
    "PATCH_NAME",
    "SCHEMA",
    "Fail",
    "Probe",
    "Skip",
    "main",
    "run_probe",
    "vllm_config",
]
