"""vLLM's tests of a checkout with and without the change, on copies of the
installed vLLM (a checkout has no compiled kernels) with the checkout's files in."""

import contextlib
import importlib.util
import shlex
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from patcher import engine
from patcher.errors import PatchError
from patcher.files import replace_at
from patcher.patchset import Patch
from patcher.tree import VllmTree, linked_copy, open_tree
from patcher.version import read_version
from vllm_patch.runtime import child, machine
from vllm_patch.runtime.patched_copy import patched_copy

PYTEST_OPTIONS = ("-q", "-p", "no:cacheprovider", "--import-mode=append")
# As vLLM's CPU jobs do: else vLLM infers the platform from a distribution named
# ``vllm``, which a checkout's own build metadata (its egg-info) may answer.
CPU_TARGET = {"VLLM_TARGET_DEVICE": "cpu"}
KEYS = ("passed", "failed", "errors", "skipped")
OUTCOMES = (("failed", "failure"), ("errors", "error"), ("skipped", "skipped"))


@dataclass(frozen=True)
class TestRun:  # one pytest run of upstream test files (or why it did not run)
    __test__ = False  # not a pytest test class

    command: str  # what a reviewer runs in the checkout
    ran: bool
    reason: str = ""  # why not, for the terminal (may name local paths)
    counts: dict[str, int] = field(default_factory=dict)  # by KEYS
    failures: tuple[str, ...] = ()  # the first ids that failed or errored
    seconds: float = 0.0
    vllm: str = ""
    torch: str = ""
    machine: str = ""  # described_machine()
    kernel_build: str = ""  # the library vLLM loads here: _C, _C_AVX512, _C_AVX2

    def summary(self) -> str:
        return ", ".join(f"{self.counts.get(k, 0)} {k}" for k in KEYS)


@dataclass(frozen=True)
class TestRuns:  # the edited tests with the change and without it
    __test__ = False

    after: TestRun
    before: TestRun | None = None
    same: tuple[str, ...] = ()  # the files the run depends on, checked
    copied: tuple[str, ...] = ()  # of those, the checkout's, copied in


def described_machine(m: dict | None = None) -> str:
    """``machine.summary`` and the instruction sets vLLM's CPU kernels use."""
    m = m or machine.facts()
    flags = ", ".join(m.get("key_flags") or ()) or "no vector extensions of note"
    return f"{machine.summary(m)}; {flags}"


def run_pytest(
    checkout: Path, files: list[str], site: Path, keyword: str | None
) -> TestRun:
    """pytest on ``files`` of ``checkout`` with ``site``'s ``vllm/`` imported."""
    k = ["-k", keyword] if keyword else []
    command = shlex.join(["pytest", *k, *files])
    with tempfile.TemporaryDirectory(prefix="vllm-patch-pytest-") as tmp:
        junit = Path(tmp) / "junit.xml"
        argv = [*PYTEST_OPTIONS, f"--rootdir={checkout}", f"--junitxml={junit}", *k]
        # cwd=site: `python -m` puts the working directory first on sys.path.
        outcome = child.run(
            "pytest:main",
            {"args": [*argv, *(str(checkout / f) for f in files)]},
            pythonpath=[site, checkout],
            env=CPU_TARGET,
            cwd=site,
        )
        if not junit.is_file():
            exited = outcome.result if outcome.ok else outcome.error
            tail = " / ".join(outcome.log.strip().splitlines()[-5:])
            return TestRun(command, False, f"pytest exited with {exited}: {tail}")
        cases = list(ET.parse(junit).getroot().iter("testcase"))
    counts, failures, why = dict.fromkeys(KEYS, 0), [], ""
    for case in cases:
        kind, said = next(
            ((k, e) for k, tag in OUTCOMES if (e := case.find(tag)) is not None),
            ("passed", None),
        )
        counts[kind] += 1
        if kind in ("failed", "errors"):
            failures.append(f"{case.get('classname')}::{case.get('name')}")
        why = why or (said.get("message", "") if kind == "skipped" else "")
    if not (counts["passed"] or counts["failed"] or counts["errors"]):
        return TestRun(command, False, f"every test skipped ({len(cases)}): {why}")
    return TestRun(
        command,
        ran=True,
        counts=counts,
        failures=tuple(failures[:10]),
        seconds=round(outcome.seconds, 1),
        vllm=str(read_version(VllmTree(site)) or "unknown"),
        torch=machine.distribution_version("torch") or "not installed",
        machine=described_machine(),
        kernel_build=machine.kernel_build(site / "vllm"),
    )


def compared(
    checkout: Path, patch: Patch, depends: list[str]
) -> tuple[list[str], list[str]]:
    """``depends``' files (same, differing) as the installed vLLM,
    patched or not."""
    trees = (VllmTree(checkout), open_tree(None))

    def files(tree: VllmTree, entry: str) -> set[str]:
        found = (tree.location / entry).rglob("*.py") if entry.endswith("/") else ()
        return {p.relative_to(tree.location).as_posix() for p in found} or {entry}

    names = sorted(set().union(*(files(t, d) for t in trees for d in depends)))
    mine, theirs = (
        {n: t.read_bytes(n) if t.exists(n) else None for n in names} for t in trees
    )
    changes = engine.plan(trees[1], patch).file_changes()
    patched = {rel: after and after.encode() for rel, (_, after) in changes.items()}
    same = [n for n in names if mine[n] in (theirs[n], patched.get(n, theirs[n]))]
    return same, [n for n in names if n not in same]


def own_sides(checkout: Path, patch: Patch, names: list[str]) -> dict:
    """The checkout's ``names`` (edited by ``patch``)
    without and with the change."""
    tree = VllmTree(checkout)
    sides = [
        engine.plan(tree, patch, d).file_changes() for d in ("revert", "apply")
    ]
    return {
        n: tuple(c[n][1].encode() if n in c else tree.read_bytes(n) for c in sides)
        for n in names
    }


@dataclass(frozen=True)
class Copies:  # the installed vLLM twice, for children's PYTHONPATH
    patched: Path
    base: Path
    same: tuple[str, ...] = ()  # the files the run depends on, checked the same
    put_in: tuple[str, ...] = ()  # the checkout's files in place of the build's


class Unavailable(Exception):
    """Why the copies cannot be made here (no vLLM or torch, or the installed
    vLLM differs from the checkout beyond the patch's files)."""


@contextlib.contextmanager
def sides(
    checkout: Path | None, patch: Patch, depends: list[str]
) -> Iterator[Copies]:
    """Two copies of the installed vLLM, with and without ``patch``, built once a
    run. With ``checkout``, its files that differ are put in (its code then runs
    in them); without, the copies hold only the build's files and the change.
    Raises :class:`Unavailable` before anything is copied."""
    try:
        installed = open_tree(None)
    except PatchError:
        raise Unavailable(f"no vLLM installed for {sys.executable}") from None
    if importlib.util.find_spec("torch") is None:
        raise Unavailable("no torch in this environment")
    same, differing = compared(checkout, patch, depends) if checkout else ([], [])
    edited = {e.file for e in patch.edits}
    foreign = ", ".join(f for f in differing if f not in edited)
    if foreign:
        raise Unavailable(
            f"the checkout and the vLLM {read_version(installed)} installed for "
            f"{sys.executable} differ in {foreign}"
        )
    own = own_sides(checkout, patch, differing) if checkout else {}
    with (
        patched_copy(installed, patch) as site,
        tempfile.TemporaryDirectory(prefix="vllm-patch-base-") as tmp,
    ):
        base = linked_copy(installed, Path(tmp)).location
        for rel, (before, after) in own.items():
            replace_at(site / rel, after)
            replace_at(base / rel, before)
        yield Copies(site, base, tuple(same), tuple(own))


def run_tests(
    copies: Copies | None,
    checkout: Path,
    files: list[str],
    keyword: str | None = None,
    why_not: str = "",
) -> TestRuns:
    """The edited tests on ``copies`` with and without the change, or why not."""
    present = [f for f in files if (checkout / f).is_file()]
    command = shlex.join(["pytest", *(["-k", keyword] if keyword else []), *files])
    why_not = why_not or ("" if present else "not in this checkout")
    if why_not or copies is None:
        said = (
            why_not
            if why_not.startswith("skipped")
            else f"cannot run here ({why_not})"
        )
        print(
            f"upstream tests: {said}; the description gives the reviewer's command"
        )
        return TestRuns(TestRun(command, False, said))
    said = [f"{', '.join(copies.same)} the same in both"] if copies.same else []
    said += (
        [f"the checkout's {', '.join(copies.put_in)} put in"]
        if copies.put_in
        else []
    )
    print(
        f"upstream tests: running {command} of the checkout on CPU against vLLM "
        f"{read_version(VllmTree(copies.patched))}, with and without the change "
        f"({'; '.join(said)}). This runs the checkout's own code (the test files "
        "and what they import); --no-tests skips them",
        flush=True,
    )
    after = run_pytest(checkout, present, copies.patched, keyword)
    before = run_pytest(checkout, present, copies.base, keyword)
    fails = f"; without the change: {before.summary()}" if before.ran else ""
    outcome = after.summary() + fails if after.ran else after.reason
    print(f"upstream tests: {outcome}")
    return TestRuns(after, before, copies.same, copies.put_in)
