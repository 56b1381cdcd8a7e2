"""The upstream patch on a hard-linked copy of the installed vLLM, checked in a
child that imports the copy: ``vllm_c`` supported and right on CPU, the
platform's priority, the provider standing down; then reverted byte-identically.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from compat_matrix.probe import child_tasks
from compat_matrix.probe.checks.kernels import truncation_note
from compat_matrix.probe.framework import PATCH_NAME, Fail, Probe, Skip, need_ir
from compat_matrix.probe.vllm_ir import (
    PRIORITY_METHOD,
    UPSTREAM_PROVIDER,
    has_vllm_ir,
)
from patcher import engine
from patcher.errors import PatchError
from patcher.patchset import select
from patcher.status import PlanStatus
from patcher.tree import open_tree
from vllm_patch.runtime import child
from vllm_patch.runtime.patched_copy import patched_copy


@dataclass
class Started:
    """The patched copy and the child importing it, under way."""

    files: list[str]
    details: dict[str, Any]
    """What the patched copy records (``vllm_patch.runtime.patched_copy``), and more."""
    child: child.Child
    stack: ExitStack
    """Ends the child if still running, then reverts and removes the copy."""


def start_upstream(p: Probe) -> Started:
    """Apply the patch to a hard-linked copy and start the child that imports it
    (a fork taken before this process imported vLLM, or a fresh interpreter:
    vLLM must be imported from the copy), without waiting: the probe starts
    this first so that the child runs beside the other checks."""
    if not has_vllm_ir():
        raise Skip("vllm.ir unavailable (see ir_present)")
    original = open_tree(None)
    patch = select([PATCH_NAME])[0]
    files = sorted({e.file for e in patch.edits})
    details: dict[str, Any] = {"original": str(original.location), "files": files}
    if engine.plan(original, patch, "apply").status is PlanStatus.APPLIED:
        raise Skip(
            "this vLLM already has the change (upstream, or patched in place): "
            "nothing to apply",
            details,
        )
    fork = not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)
    if fork:
        child_tasks.preload()
    stack = ExitStack()
    try:
        try:
            copy = stack.enter_context(patched_copy(original, patch, record=details))
        except PatchError as exc:  # names the file, what it looked for and found
            raise Fail(f"the patch engine refused to apply: {exc}", details) from None
        if not details["changed"]:
            raise Fail(
                f"apply changed nothing on a pristine copy: {details['apply']}",
                details,
            )
        # A fork when this process has not imported vLLM yet (the probe starts
        # this first): the child imports vLLM from the copy, the rest preloaded.
        started = child_tasks.start_task(
            "patched_vllm", {"module": p.module_name}, pythonpath=[copy], fork=fork
        )
        stack.callback(child.stop, started)
    except BaseException:
        stack.close()
        raise
    return Started(files, details, started, stack)


def check_upstream_patch(p: Probe) -> tuple[str, dict]:
    need_ir(p)
    started = p.started.pop("upstream_patch", None) or start_upstream(p)
    with started.stack:
        result = child_tasks.finish_task(started.child)
        started.details["child"] = result
    files, details = started.files, started.details
    details["originals_untouched"] = details["original_unchanged"]
    problems, unchecked = [], []
    if not details["originals_untouched"]:
        problems.append("the installed vLLM's files changed")
    if not details.get("restored"):
        problems.append(
            f"revert did not restore the copy byte-identically: {details.get('hashes')}"
        )
    if not result.get("ok"):
        problems.append(f"the patched copy's child failed: {result['error']}")
    else:
        found, unchecked = upstream_child_problems(
            result["result"], p, str(details["copy"])
        )
        problems += found + strided_problems(result["result"].get("strided_inputs", {}))
    details["problems"], details["unchecked"] = problems, unchecked
    if problems:
        raise Fail(problems[0], details)
    if unchecked:
        raise Skip(
            "the patch applies to a copy and reverts byte-identically; "
            + "; ".join(unchecked),
            details,
        )
    r = result["result"]
    return (
        f"applied to a hard-linked copy ({', '.join(files)}): {UPSTREAM_PROVIDER!r} "
        f"supported on CPU for {', '.join(r['ops'])}, numerics within tolerance, "
        f"{r['platform_class']}.{PRIORITY_METHOD} gives {UPSTREAM_PROVIDER!r} first "
        "eager and native for Inductor, the provider stands down; "
        "revert byte-identical" + truncation_note(r.get("numerics", [])),
        details,
    )


def strided_problems(strided: dict) -> list[str]:
    """Wrong answers for non-contiguous inputs under the patched ``vllm_c``: the
    CPU kernels assume contiguous rows, so the patch must send such inputs to
    native (its supports_args guard)."""
    out = []
    for op, result in strided.items():
        for layout in ("transposed", "row_strided"):
            case = result.get(layout) or {}
            if case and not case["right"]:
                worst = max(case["max_abs_diff"])
                out.append(
                    f"{UPSTREAM_PROVIDER!r} {op} is wrong for {layout} inputs "
                    f"(dispatched to {case['dispatched_to']!r}, max abs diff {worst:g})"
                )
    return out


def upstream_child_problems(
    r: dict, p: Probe, copy: str
) -> tuple[list[str], list[str]]:
    """What is wrong with the patched copy, and what could not be checked here."""
    problems, unchecked = _kernel_problems(r, p, copy)
    if r.get("config_error"):
        unchecked.append(
            f"priority not checked, vLLM's config does not build: {r['config_error']}"
        )
        return problems, unchecked
    return problems + _priority_problems(r, p), unchecked


def _kernel_problems(r: dict, p: Probe, copy: str) -> tuple[list[str], list[str]]:
    """The copy's ``vllm_c`` norms: imported from the copy, supported on CPU,
    and right (unless this environment cannot run the kernels)."""
    problems, unchecked = [], []
    if not r["vllm_file"].startswith(copy):
        problems.append(f"the child imported vLLM from {r['vllm_file']}, not the copy")
    if not r["ops"]:
        problems.append(f"no {UPSTREAM_PROVIDER!r} norm impl in the patched copy")
    for op in r["ops"]:
        if not r["supported"][op]:
            problems.append(
                f"{UPSTREAM_PROVIDER!r} not supported on CPU for {op} after the patch"
            )
    if p.kernels_unavailable:
        unchecked.append(f"kernels not run: {p.kernels_unavailable}")
    else:
        bad = [c for c in r.get("numerics", []) if not c["ok"]]
        if bad or not r.get("numerics"):
            problems.append(
                f"{UPSTREAM_PROVIDER!r} numerics off: {bad[:1] or 'none run'}"
            )
    return problems, unchecked


def _priority_problems(r: dict, p: Probe) -> list[str]:
    """The platform's priority on the copy (``vllm_c`` first eager, native
    under Inductor), and the provider standing down there when opted in."""
    problems = []
    for op in r["ops"]:
        eager, inductor = r["platform_eager"].get(op), r["platform_inductor"].get(op)
        if not eager or eager[0] != UPSTREAM_PROVIDER:
            problems.append(f"{PRIORITY_METHOD} eager gives {eager} for {op}")
        if not inductor or inductor[0] != "native":
            problems.append(f"{PRIORITY_METHOD} Inductor gives {inductor} for {op}")
    stand = r.get("provider_with_opt_in")
    if stand is not None:
        for op in r["ops"]:
            final = stand["final"].get(op) or [None]
            if final[0] != UPSTREAM_PROVIDER or p.name in final:
                problems.append(f"with opt-in on the patched copy {op} got {final}")
        if not stand["status"].get("redundant"):
            problems.append(
                "the provider did not report itself redundant on the patched copy"
            )
    return problems
