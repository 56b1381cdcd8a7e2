"""What the doctor imports in a child interpreter (``vllm_patch.runtime.child``):
a step that raises, aborts or crashes it fails alone; a new child runs the rest."""

from __future__ import annotations

from typing import Any

from vllm_patch.runtime import child

CHILD_TIMEOUT = 300
VLLM_KERNELS = ("kernels", "vllm")
TORCH = ("import", "torch")
CONFIG_MODULE = "vllm.config"
TRANSFORMERS = "transformers:LlamaConfig"
IR = "vllm.ir.op:IrOp"


def steps_for(providers: list[str], companions: list[str], ir: bool) -> list[list[str]]:
    """Every step, in the order the child runs them (vLLM IR's with ``ir``)."""
    return [
        list(TORCH),
        list(VLLM_KERNELS),
        ["import", CONFIG_MODULE],
        ["from", TRANSFORMERS],
        *([["from", IR]] if ir else []),
        *(["provider", m] for m in providers),
        *(["import", c] for c in companions),
    ]


def run_import_checks(steps: list[list[str]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Each step's result by ``(kind, argument)``; a step that killed its
    interpreter (or hung) is a failure, and a new child runs the steps after it."""
    results: dict[tuple[str, str], dict[str, Any]] = {}
    while steps:
        outcome = child.run(
            "vllm_patch.runtime.import_checks:run_steps",
            {"steps": steps},
            timeout=CHILD_TIMEOUT,
        )
        for result in outcome.reported:
            results[tuple(result.pop("step"))] = result
        done = len(outcome.reported)
        if done < len(steps):
            died = outcome.error
            if outcome.timed_out:
                died = f"no answer within {CHILD_TIMEOUT} s"
            error = f"the interpreter died while importing ({died})"
            results[tuple(steps[done])] = {"ok": False, "error": error}
        steps = steps[done + 1 :]
    return results
