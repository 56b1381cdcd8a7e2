"""Every check, in the order they run and appear in the document: the one list
the probe runs and the matrix reads. A check takes the ``Probe`` and returns
``(reason, details)`` on a pass, or raises ``Skip`` / ``Fail``; later checks
read what earlier ones left on the ``Probe``.

Each entry names its function as ``module:function`` in this package, imported
when the probe runs it: the matrix reads the names without importing vLLM,
torch or the patch engine.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

CHECKS: dict[str, str] = {
    "ir_present": "registration:check_ir_present",
    "provider_registers": "registration:check_provider_registers",
    "plugin_entry_point": "registration:check_plugin_entry_point",
    "kernels_supported": "kernels:check_kernels_supported",
    "numerics": "kernels:check_provider_numerics",
    "dispatch": "kernels:check_dispatch",
    "kernel_config": "kernel_config:check_kernel_config",
    "upstream_patch": "upstream_patch:check_upstream_patch",
    "e2e": "engine_start:check_e2e",
}

# Cheap, in-process, and what the other checks build on: they run even when
# --only leaves them out.
PREREQUISITES = ("ir_present", "provider_registers", "kernels_supported")

# The checks whose slow part (a process importing vLLM) starts before the checks
# run, so that it runs beside the in-process ones: the patched copy's child
# first, then the fork for vLLM's plugin loader (before the provider registers).
STARTED_AHEAD: dict[str, str] = {
    "upstream_patch": "upstream_patch:start_upstream",
    "plugin_entry_point": "registration:start_plugin_child",
}


def resolve(entry: str) -> Callable[..., Any]:
    """The function a ``module:function`` entry above names."""
    module, _, function = entry.partition(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), function)
