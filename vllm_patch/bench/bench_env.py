"""Where the bench runs: the installed vLLM, and patched copies of it.

An upstream provider that the installed tree gates off (say ``"vllm_c"`` on
CPU) can still be measured: on a patched copy of the installed vLLM
(``vllm_patch.runtime.patched_copy``), in a child whose ``PYTHONPATH`` starts with it
(``vllm_patch.runtime.child``). Each child gets one environment and one thread count.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from patcher import engine
from patcher.patchset import Patch, all_patches
from patcher.status import PlanStatus
from patcher.tree import VllmTree


@dataclass(frozen=True)
class BenchEnv:
    label: str
    """``installed`` or ``patched copy (<patch>)``: goes into every row."""
    python: str = sys.executable
    pythonpath: tuple[str, ...] = ()
    """First on the child's ``PYTHONPATH``: the patched copy, if any."""


def patches_to_copy(tree: VllmTree) -> tuple[list[Patch], list[str]]:
    """Patches that apply to the installed tree (so a patched copy differs from
    it), and notes on the others."""
    chosen, notes = [], []
    for patch in all_patches():
        try:
            status = engine.plan(tree, patch).status
        except Exception as exc:  # a tree the engine cannot read is a finding
            notes.append(f"patch {patch.name}: cannot plan: {exc}")
            continue
        if status in (PlanStatus.APPLICABLE, PlanStatus.PARTLY_APPLIED):
            chosen.append(patch)
        else:
            notes.append(f"patch {patch.name}: {status} to the installed tree")
    return chosen, notes
