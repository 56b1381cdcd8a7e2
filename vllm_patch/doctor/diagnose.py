"""``vllm-patch doctor``: one finding per line (``ok``, ``info`` or ``fix`` with
its command); exit 0 without a ``fix``, else 1. Every import of torch, vLLM or
transformers runs in a child: a step that crashes it fails alone."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from dataclasses import asdict
from importlib import metadata
from typing import Any

from patcher import engine
from patcher.errors import ExitCode, PatchError
from patcher.patchset import all_patches
from patcher.tree import open_tree
from vllm_patch.doctor import findings
from vllm_patch.doctor.findings import Finding
from vllm_patch.runtime import child

CHILD_TIMEOUT = 300


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_import_checks(steps: list[list[str]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Each step's result by ``(kind, argument)``; one that killed its child (or
    hung) fails, and a new child runs the rest."""
    results: dict[tuple[str, str], dict[str, Any]] = {}
    while steps:
        outcome = child.run(
            "vllm_patch.runtime.import_checks:run_steps",
            {"steps": steps},
            timeout=CHILD_TIMEOUT,
        )
        results |= {tuple(r.pop("step")): r for r in outcome.reported}
        if (done := len(outcome.reported)) < len(steps):
            hung = f"no answer within {CHILD_TIMEOUT} s"
            died = hung if outcome.timed_out else outcome.error
            error = f"the interpreter died while importing ({died})"
            results[tuple(steps[done])] = {"ok": False, "error": error}
        steps = steps[done + 1 :]
    return results


def diagnose() -> list[Finding]:
    try:
        tree = open_tree(None)
    except PatchError as exc:
        fix = findings.pip("install", findings.CPU_DISTRIBUTION)
        return [Finding("vllm", "fix", f"no vLLM for this Python: {exc}", fix)]
    dist = metadata.PathDistribution(tree.dist_info) if tree.dist_info else None
    patches = all_patches()
    providers = [m for p in patches if (m := findings.provider_module(p))]
    progress(
        "vllm-patch doctor: importing torch, vLLM, transformers and the "
        "providers in a child interpreter (some seconds) ..."
    )
    results = run_import_checks(findings.steps_for(tree, providers))
    out = findings.vllm_findings(tree, dist) + findings.import_findings(results, dist)
    plans = {patch.name: engine.plan(tree, patch) for patch in patches}
    for patch in patches:
        out += findings.patch_findings(tree, patch, plans, results)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--fix",
        action="store_true",
        help="remove the packages that do not import beside this torch "
        "(`python -I -m pip uninstall`, said first), then check again",
    )


def run(args: argparse.Namespace) -> int:
    found = diagnose()
    commands = list(dict.fromkeys(tuple(f.fix_argv) for f in found if f.fix_argv))
    if args.fix and commands:
        said = "".join(f"\n  {shlex.join(argv)}" for argv in commands)
        progress(f"vllm-patch doctor --fix runs, in this order:{said}")
        for argv in commands:  # stdout: the findings; cwd: an empty folder
            with tempfile.TemporaryDirectory(prefix="vllm-patch-fix-") as cwd:
                subprocess.run(argv, check=False, stdout=sys.stderr, cwd=cwd)
        found = diagnose()
    ok = not any(f.status == "fix" for f in found)
    if args.json:
        said = [{k: v for k, v in asdict(f).items() if k != "fix_argv"} for f in found]
        doc = {"python": sys.executable, "ok": ok, "findings": said}
        print(json.dumps(doc, indent=2))
    else:
        for f in found:
            print(f.line())
        print("all well" if ok else "something needs fixing (see FIX above)")
    return ExitCode.OK if ok else ExitCode.PENDING
