"""Run vLLM's own tests, from a checkout, against the vLLM installed here.

vLLM's tests import both ``vllm`` and ``tests``: ``vllm`` must be a built vLLM
(the checkout's sources have no compiled kernels), ``tests`` the checkout's. So
pytest runs in a child interpreter (``vllm_patch.runtime.child``) with a site
folder holding a built ``vllm/`` (a hard-linked copy of the installed vLLM,
patched or not) first, then the checkout; ``--import-mode=append`` keeps pytest
from putting the checkout's ``vllm/`` sources first. ``--noconftest`` leaves
out vLLM's ``tests/conftest.py``, which needs vLLM's test requirements
(``tblib`` and more) that a runtime install lacks; the IR kernel tests use none
of its fixtures. The outcome is counted from pytest's JUnit XML."""

from __future__ import annotations

import importlib.util
import shlex
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import Version

from patcher.errors import PatchError
from patcher.patchset import Patch
from patcher.tree import VllmTree, open_tree
from patcher.version import read_version
from vllm_patch.runtime import child, machine
from vllm_patch.runtime.patched_copy import patched_copy

PYTEST_OPTIONS = ("-p", "no:cacheprovider", "--noconftest", "--import-mode=append")
# vLLM's CPU test jobs name the platform: vLLM otherwise infers it from the
# version of a distribution called ``vllm``, which a checkout's own build
# metadata (``vllm.egg-info`` of a build for another platform) may answer.
CPU_TARGET = {"VLLM_TARGET_DEVICE": "cpu"}


@dataclass(frozen=True)
class TestRun:
    """One pytest run of upstream test files (or why it did not run)."""

    __test__ = False  # not a pytest test class

    files: tuple[str, ...]
    command: str
    """What a reviewer runs in the checkout (paths relative to it)."""
    ran: bool
    reason: str = ""
    """Why it did not run (for the terminal: it may name local paths)."""
    counts: dict[str, int] = field(default_factory=dict)
    """``passed``, ``failed``, ``errors``, ``skipped``."""
    failures: tuple[str, ...] = ()
    """Test ids that failed or errored (the first few)."""
    seconds: float = 0.0
    vllm: str = ""
    torch: str = ""
    machine: str = ""
    """CPU model, architecture and the instruction sets the kernels use."""

    def summary(self) -> str:
        order = ("passed", "failed", "errors", "skipped")
        return ", ".join(f"{self.counts.get(k, 0)} {k}" for k in order)


def reviewer_command(files: list[str], keyword: str | None = None) -> str:
    selected = ["-k", keyword] if keyword else []
    return shlex.join(["pytest", *selected, *files])


def described_machine() -> str:
    """``CPU model (arch; instruction sets the kernels use)``."""
    m = machine.facts()
    flags = ", ".join(m["key_flags"]) or "no vector extensions of note"
    return f"{m['cpu_model']} ({m['arch']}; {flags})"


def run_pytest(
    checkout: Path, files: list[str], site: Path, keyword: str | None = None
) -> TestRun:
    """pytest on ``files`` (or ``file::test`` ids) of ``checkout``, with
    ``site``'s ``vllm/`` imported; ``keyword`` is pytest's ``-k``."""
    with tempfile.TemporaryDirectory(prefix="vllm-patch-pytest-") as tmp:
        junit = Path(tmp) / "junit.xml"
        argv = [*PYTEST_OPTIONS, "-q", f"--rootdir={checkout}", f"--junitxml={junit}"]
        argv += ["-k", keyword] if keyword else []
        argv += [str(checkout / f) for f in files]
        print(
            f"vllm-patch: running {reviewer_command(files)} on CPU (minutes)...",
            file=sys.stderr,
            flush=True,
        )
        # cwd=site: `python -m` puts the working directory first on sys.path.
        outcome = child.run(
            "vllm_patch.upstream.vllm_tests:pytest_main",
            {"argv": argv},
            pythonpath=[site, checkout],
            env=CPU_TARGET,
            cwd=site,
        )
        if not junit.is_file():
            exited = outcome.result if outcome.ok else outcome.error
            tail = outcome.log.strip().splitlines()[-5:]
            return TestRun(
                tuple(files),
                reviewer_command(files),
                ran=False,
                reason=f"pytest exited with {exited} before running: "
                + " / ".join(tail),
            )
        counts, failures, skipped_why = _junit(junit)
    if not (counts["passed"] or counts["failed"] or counts["errors"]):
        why = f": {skipped_why}" if skipped_why else ""
        return TestRun(
            tuple(files),
            reviewer_command(files, keyword),
            ran=False,
            reason=f"every test skipped ({counts['skipped']}){why}",
        )
    return TestRun(
        tuple(files),
        reviewer_command(files, keyword),
        ran=True,
        counts=counts,
        failures=failures,
        seconds=round(outcome.seconds, 1),
        vllm=_version_of(site),
        torch=machine.distribution_version("torch") or "not installed",
        machine=described_machine(),
    )


def pytest_main(argv: list[str]) -> int:
    """pytest's exit code on ``argv``: the child's side of :func:`run_pytest`."""
    import pytest  # a dependency of vllm-patch: the child runs in its environment

    return int(pytest.main(argv))


def _junit(path: Path) -> tuple[dict[str, int], tuple[str, ...], str]:
    """The counts, the tests that failed (the first few) and the first reason
    a test was skipped for."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for key in total:
            total[key] += int(suite.get(key, 0))
    failures = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in root.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    counts = {
        "passed": passed,
        "failed": total["failures"],
        "errors": total["errors"],
        "skipped": total["skipped"],
    }
    skips = (case.find("skipped") for case in root.iter("testcase"))
    why = next((s.get("message", "") for s in skips if s is not None), "")
    return counts, tuple(failures[:10]), why


def _version_of(site: Path) -> str:
    version = read_version(VllmTree(site))
    return str(version) if version else "unknown"


def unavailable(checkout: Path, files: list[str], want: Version | None) -> str | None:
    """Why the tests of ``files`` cannot run here against a matching vLLM
    build, or None when they can (said before ``pr`` commits)."""
    if not any((checkout / f).is_file() for f in files):
        return "not in this checkout"
    try:
        installed = open_tree(None)
    except PatchError:
        return f"no vLLM installed for {sys.executable}"
    if importlib.util.find_spec("torch") is None:
        return "no torch in this environment"
    have = read_version(installed)
    if want is None or want != have:
        return (
            f"the checkout is vLLM {want or 'of unknown version'}, the vLLM installed "
            f"for {sys.executable} is {have or 'of unknown version'}; the tests need "
            "a matching build"
        )
    return None


def measure(
    checkout: Path,
    files: list[str],
    patch: Patch,
    want: Version | None,
    keyword: str | None = None,
) -> TestRun:
    """The upstream tests of a vLLM ``want`` checkout on a patched, hard-linked
    copy of the installed vLLM, or why they cannot run here."""
    present = [f for f in files if (checkout / f).is_file()]
    command = reviewer_command(present or files, keyword)
    why_not = unavailable(checkout, files, want)
    if why_not:
        return TestRun(tuple(present or files), command, False, why_not)
    with patched_copy(open_tree(None), patch) as site:
        return run_pytest(checkout, present, site, keyword)
