"""A hostile backup manifest: unreadable ones (a FIFO, a document nested past
the parser, one over the bound) are damage, reported, and revert falls back to
the inverse edit; a link is a plant, refused (exit 3) by revert, the one
command that reads it. A linked work tree, with no git directory of its own,
reverts by the inverse edit."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import git
import pytest
from conftest import make_tree, snapshot

from patcher.backup import BACKUP_DIR, MAX_MANIFEST_BYTES
from vllm_patch.cli import main

MANIFEST = f"{BACKUP_DIR}/cpu_fused_norms/manifest.json"


def replaced(make: Callable[[Path], object]) -> Callable[[Path], None]:
    def plant(path: Path) -> None:
        path.unlink()
        make(path)

    return plant


DAMAGE = [
    pytest.param(replaced(os.mkfifo), "FIFO", id="fifo"),
    pytest.param(
        replaced(lambda p: p.write_text("[" * 100_000)),
        "JSON nested too deep",
        id="nested",
    ),
    pytest.param(
        replaced(lambda p: p.write_bytes(b" " * (MAX_MANIFEST_BYTES + 1))),
        "file too large",
        id="over-the-bound",
    ),
]


@pytest.mark.parametrize("damage,says", DAMAGE)
def test_an_unreadable_manifest_is_damage(installed, capsys, damage, says) -> None:
    original = snapshot(installed)
    assert main(["apply", "--vllm", str(installed)]) == 0
    damage(installed / MANIFEST)
    capsys.readouterr()
    assert main(["revert", "--vllm", str(installed)]) == 0
    err = capsys.readouterr().err
    assert "damaged backup" in err and says in err and "Traceback" not in err
    assert snapshot(installed) == original


@pytest.mark.parametrize("verb", ["check", "diff", "apply", "revert"])
def test_a_manifest_linked_to_a_device_is_refused(installed, capsys, verb) -> None:
    assert main(["apply", "--vllm", str(installed)]) == 0
    (installed / MANIFEST).unlink()
    (installed / MANIFEST).symlink_to("/dev/zero")
    before = snapshot(installed)
    capsys.readouterr()
    assert main([verb, "--vllm", str(installed)]) == (3 if verb == "revert" else 0)
    out = capsys.readouterr()
    said = out.out + out.err
    assert verb != "revert" or (
        f"{installed / MANIFEST}: part of the backup store is a symbolic link"
        in said
    )
    assert "Traceback" not in out.err
    assert snapshot(installed) == before


def test_a_linked_work_tree_reverts_by_the_inverse_edit(tmp_path) -> None:
    main_tree = make_tree(tmp_path / "main", "checkout")
    work = tmp_path / "work"
    git.Repo(main_tree).git.worktree("add", str(work), "-b", "other")
    assert main(["apply", "--vllm", str(work)]) == 0
    assert git.Repo(work).is_dirty()
    assert main(["revert", "--vllm", str(work)]) == 0
    assert not git.Repo(work).is_dirty(untracked_files=True)
