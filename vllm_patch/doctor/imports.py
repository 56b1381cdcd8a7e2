"""What the doctor imports in a child interpreter (``vllm_patch.runtime.child``):
a step that raises, aborts or crashes it fails alone; a new child runs the rest."""

from __future__ import annotations

import sys
from typing import Any

from vllm_patch.runtime import child

CHILD_TIMEOUT = 300
VLLM_KERNELS = ("kernels", "vllm")
TORCH = ("import", "torch")
CONFIG = "vllm.config"
TRANSFORMERS = "transformers:LlamaConfig"
IR = "vllm.ir.op:IrOp"


def steps_for(providers: list[str], companions: list[str], ir: bool) -> list[list[str]]:
    """Every step, in the order the child runs them (vLLM IR's with ``ir``: a
    release from 0.20 on)."""
    return [
        list(TORCH),
        list(VLLM_KERNELS),
        ["import", CONFIG],
        ["from", TRANSFORMERS],
        *([["from", IR]] if ir else []),
        *(["provider", m] for m in providers),
        *(["import", c] for c in companions),
    ]


def run_import_checks(
    steps: list[list[str]], python: str = sys.executable
) -> dict[tuple[str, str], dict[str, Any]]:
    """Each step's result; a step that killed its interpreter (or hung) is a
    failure, and a new child runs the steps after it."""
    results: dict[tuple[str, str], dict[str, Any]] = {}
    remaining = list(steps)
    while remaining:
        outcome = child.run(
            "vllm_patch.runtime.import_checks:run_steps",
            {"steps": remaining},
            python=python,
            timeout=CHILD_TIMEOUT,
        )
        done = outcome.reported
        for result in done:
            results[tuple(result.pop("step"))] = result
        if len(done) < len(remaining):
            died = outcome.error
            died = f"no answer within {CHILD_TIMEOUT} s" if outcome.timed_out else died
            results[tuple(remaining[len(done)])] = {
                "ok": False,
                "error": f"the interpreter died while importing ({died})",
            }
        remaining = remaining[len(done) + 1 :]
    return results
