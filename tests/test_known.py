"""patcher.known: `check` answers a tree the codemods already judged from the
patch's record, and plans every other tree in full."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CPU, VLLM_C

from patcher import engine, known
from patcher.patchset import select
from patcher.status import PlanStatus
from patcher.tree import open_tree

PATCH = select(["cpu_fused_norms"])[0]


@pytest.fixture
def recorded(tree: Path, tmp_path: Path):
    """The patch, from a copy of its folder whose record holds ``tree``."""
    folder = tmp_path / "patch"
    shutil.copytree(PATCH.folder, folder, ignore=shutil.ignore_patterns("rendered"))
    patch = dataclasses.replace(PATCH, folder=folder)
    plan = engine.plan(open_tree(tree), patch)
    entry = known.entry("fixture", plan.sources, plan.file_changes())
    (folder / "rendered").mkdir()
    (folder / "rendered" / known.FILE_NAME).write_text(known.document(folder, [entry]))
    return patch


def _judged(tree: Path, patch) -> str | None:
    return known.judged(open_tree(tree), patch.folder, [VLLM_C, CPU])


def test_a_recorded_tree_is_known_before_and_after(tree, recorded):
    assert _judged(tree, recorded) == "applicable"
    verdict = engine.check(open_tree(tree), recorded)
    assert verdict == engine.Verdict.of(engine.plan(open_tree(tree), recorded))
    engine.apply(open_tree(tree), recorded)
    assert _judged(tree, recorded) == "applied"
    assert engine.check(open_tree(tree), recorded).status is PlanStatus.APPLIED


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(
            lambda tree, folder: (tree / CPU).write_text("x = 1\n"), id="file"
        ),
        pytest.param(lambda tree, folder: (tree / VLLM_C).unlink(), id="missing-file"),
        pytest.param(
            lambda tree, folder: (folder / "cpu_priority.py").write_text("# new\n"),
            id="codemod-changed",
        ),
        pytest.param(
            lambda tree, folder: (folder / "rendered" / known.FILE_NAME).write_text(
                "[" * 100_000
            ),
            id="record-garbled",
        ),
        pytest.param(
            lambda tree, folder: (folder / "rendered" / known.FILE_NAME).write_text(
                '{"fingerprint": 1, "trees": "no"}'
            ),
            id="record-wrong-shape",
        ),
    ],
)
def test_anything_else_is_planned_in_full(tree, recorded, change):
    change(tree, recorded.folder)
    assert _judged(tree, recorded) is None


def test_a_shim_is_planned_in_full(tree, recorded, monkeypatch):
    seen = []
    monkeypatch.setattr(known, "judged", lambda *a: seen.append(a))
    (tree / "vllm/kernels/vllm_c_real.py").write_bytes((tree / VLLM_C).read_bytes())
    (tree / VLLM_C).write_text(
        "import sys\nimport vllm.kernels.vllm_c_real as _real\n"
        "sys.modules[__name__] = _real\n"
    )
    verdict = engine.check(open_tree(tree), recorded)
    assert seen == [] and verdict.edits[0].via == VLLM_C


def test_check_of_a_known_tree_imports_no_libcst(tree, recorded):
    """The point of the record: a check that it answers starts no LibCST."""
    code = (
        "import dataclasses, sys\n"
        "from patcher import engine\nfrom patcher.patchset import select\n"
        "from patcher.tree import open_tree\n"
        "patch = dataclasses.replace(select(['cpu_fused_norms'])[0], "
        f"folder=__import__('pathlib').Path({str(recorded.folder)!r}))\n"
        f"verdict = engine.check(open_tree({str(tree)!r}), patch)\n"
        "print(verdict.status, 'libcst' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["applicable", "False"]
