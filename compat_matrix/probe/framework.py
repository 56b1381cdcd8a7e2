"""What every check shares: how a check ends (it returns on a pass, raises
``Skip`` or ``Fail`` otherwise), the state the checks hand on to one another
(``Probe``), and the guards that skip a check whose prerequisite did not pass.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from compat_matrix.check_status import CheckStatus
from patcher.patchset import select

# What is probed: this project's patch and the provider module its patch.toml
# names (which declares its own IR provider name).
PATCH_NAME = "cpu_fused_norms"
PROVIDER_MODULE = select([PATCH_NAME])[0].meta["provider"]["module"]


class CheckOutcome(Exception):
    """How a check ended other than passing; ``status`` goes into the document."""

    status = CheckStatus.FAIL

    def __init__(self, reason: str, details: dict | None = None):
        super().__init__(reason)
        self.reason = reason
        self.details = details or {}


class Skip(CheckOutcome):
    status = CheckStatus.SKIP


class Fail(CheckOutcome):
    """The check ran and found something wrong."""


@dataclass
class Probe:
    module_name: str
    """The provider module (``PROVIDER_MODULE``)."""
    name: str
    """The IR provider name it declares (its ``PROVIDER``); "" when it does not
    import (provider_registers says why)."""
    e2e: bool = False
    ir_ok: bool = False
    module: Any = None
    ops: list[str] = field(default_factory=list)
    """Ops the provider registered an impl for, in this process."""
    kernels_unavailable: str | None = "not checked"
    """Why this environment cannot run the provider's kernels; None when it can."""
    pre_ir: str | None = None
    """Why the provider does not apply: a vLLM release from before vLLM IR."""
    started: dict[str, Any] = field(default_factory=dict)
    """Work started ahead of its check, to run beside the others (check -> handle)."""
    cleanup: ExitStack = field(default_factory=ExitStack)
    """Closed when the probe ends, whatever happened to the checks."""


def need_ir(p: Probe) -> None:
    if p.pre_ir:
        raise Skip(f"not applicable: {p.pre_ir}")
    if not p.ir_ok:
        raise Skip("vllm.ir unavailable (see ir_present)")


def need_provider(p: Probe) -> None:
    need_ir(p)
    if not p.ops:
        raise Skip("the provider did not register (see provider_registers)")


def need_kernels(p: Probe) -> None:
    need_provider(p)
    if p.kernels_unavailable:
        raise Skip(f"kernels not usable here: {p.kernels_unavailable}")
