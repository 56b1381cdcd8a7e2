"""Every check, in the order they run and appear in the document. A check takes
the ``Probe`` and returns ``(reason, details)`` on a pass, or raises ``Skip`` /
``Fail``; later checks read what earlier ones left on the ``Probe``.
"""

from __future__ import annotations

from collections.abc import Callable

from compat_matrix.probe.checks.e2e import check_e2e
from compat_matrix.probe.checks.kernel_config import check_kernel_config
from compat_matrix.probe.checks.kernels import (
    check_dispatch,
    check_kernels_supported,
    check_numerics,
)
from compat_matrix.probe.checks.registration import (
    check_ir_present,
    check_plugin_entry_point,
    check_provider_registers,
    start_plugin_child,
)
from compat_matrix.probe.checks.upstream_patch import (
    check_upstream_patch,
    start_upstream,
)
from compat_matrix.probe.children import stop_child
from compat_matrix.probe.framework import Probe

CHECKS: list[tuple[str, Callable[[Probe], tuple[str, dict]]]] = [
    ("ir_present", check_ir_present),
    ("provider_registers", check_provider_registers),
    ("plugin_entry_point", check_plugin_entry_point),
    ("kernels_supported", check_kernels_supported),
    ("numerics", check_numerics),
    ("dispatch", check_dispatch),
    ("kernel_config", check_kernel_config),
    ("upstream_patch", check_upstream_patch),
    ("e2e", check_e2e),
]


# Cheap, in-process, and what the other checks build on: they run even when
# --only leaves them out.
PREREQUISITES = ("ir_present", "provider_registers", "kernels_supported")


def start_ahead(p: Probe, only: list[str] | None) -> None:
    """Start the checks' slow parts (each a process importing vLLM) before the
    checks run, so that they run beside the in-process checks instead of one
    after another: the patched copy's fresh interpreter first, then a fork of
    this process for vLLM's plugin loader (before the provider registers here).
    A part that cannot start is left to its check, which then says why."""
    for name, start in (
        ("upstream_patch", start_upstream),
        ("plugin_entry_point", start_plugin_child),
    ):
        if only and name not in only:
            continue
        try:
            started = start(p)
        except Exception:  # the check runs it again and reports the reason
            continue
        if started is None:
            continue
        p.started[name] = started
        stack = getattr(started, "stack", None)
        p.cleanup.callback(
            stack.close if stack else stop_child, *([] if stack else [started])
        )
