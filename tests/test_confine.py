"""A tree someone else prepared cannot turn vllm-patch against its user: a
planted backup manifest, backup link, source or folder link makes every command
that reads it refuse it (exit 3, one message naming the plant) and change
nothing; a plant no command reads (an old intent record, a ``.git`` file, a
leftover's name) is never followed. The victim folder beside the tree, which
holds what each plant aims at, never changes; nor does the tree on a refusal.
The folder-swap race: ``vllm/kernels`` swapped for a link while apply and
revert loop never lets a write land outside."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import git
import pytest
from conftest import VLLM_C, make_tree, snapshot

from patcher.backup import BACKUP_DIR
from vllm_patch.cli import main

PAYLOAD = b"print('owned')\n"
VERBS = ("list", "check", "diff", "apply", "revert")
STORE = f"{BACKUP_DIR}/cpu_fused_norms"


@pytest.fixture(scope="module")
def victim_template(tmp_path_factory) -> Path:
    return make_victim(tmp_path_factory.mktemp("template"))


def make_victim(root: Path) -> Path:
    """Files an attacker would like vllm-patch to delete or overwrite: some
    named like its leftovers, a backup store, an empty folder, a source."""
    victim = root / "victim"
    (victim / "empty").mkdir(parents=True)
    (victim / "victim.txt").write_bytes(b"keep me\n")
    (victim / "payload").write_bytes(PAYLOAD)
    for name in (".notes.vllm-patch.new", ".v1.txt.backup01.tmp", "v1.txt"):
        (victim / name).write_bytes(b"keep\n")
    (victim / ".vllm_c.py.vllm-patch.new").write_bytes(b"keep\n")
    (victim / ".vllm_c.py.k2j_9x0a.tmp").write_bytes(b"keep\n")
    make_tree(victim / "store-tree", "installed")
    assert main(["apply", "--vllm", str(victim / "store-tree")]) == 0
    shutil.copytree(victim / "store-tree" / BACKUP_DIR, victim / BACKUP_DIR)
    return victim


Plant = Callable[[Path, Path], object]


def link(rel: str, to: Callable[[Path], Path]) -> Plant:
    def plant(tree: Path, victim: Path) -> None:
        path = tree / rel
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(to(victim))

    return plant


def backup_then(plant: Plant) -> Plant:
    """Applied first (a real backup), then the plant."""

    def both(tree: Path, victim: Path) -> None:
        assert main(["apply", "--vllm", str(tree)]) == 0
        plant(tree, victim)

    return both


def foreign_manifest_entry(tree: Path, victim: Path) -> None:
    manifest = tree / STORE / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["files"]["../../victim/victim.txt"] = doc["files"][VLLM_C]
    manifest.write_text(json.dumps(doc))


def git_file_to(victim_dir: str) -> Plant:
    def plant(tree: Path, victim: Path) -> None:
        shutil.rmtree(tree / ".git")
        (tree / ".git").write_text(f"gitdir: {victim / victim_dir}\n")

    return plant


def source_elsewhere(tree: Path, victim: Path) -> None:
    shutil.copy(tree / VLLM_C, victim / "vllm_c.py")
    link(VLLM_C, lambda v: v / "vllm_c.py")(tree, victim)


def folder_elsewhere(tree: Path, victim: Path) -> None:
    """``vllm/kernels`` a link to a copy of it outside."""
    shutil.copytree(tree / "vllm/kernels", victim / "kernels")
    link("vllm/kernels", lambda v: v / "kernels")(tree, victim)


def leftover_link(tree: Path, victim: Path) -> None:
    """A name like the new file an interrupted write leaves, linking out."""
    (tree / "vllm/kernels/.vllm_c.py.0123456789ab.vllm-patch.new").symlink_to(
        victim / "victim.txt"
    )


def old_journal(tree: Path, victim: Path) -> None:
    """The intent record of earlier versions, naming the victim: not read."""
    doc = {"operation": "revert of cpu_fused_norms", "remove": [str(victim)]}
    (tree / ".vllm-patch-journal.json").write_text(json.dumps(doc))


ALL = dict.fromkeys(VERBS[1:], 3)
PLAIN = {"check": 1, "diff": 0, "apply": 0, "revert": 0}  # the plant is not read
WRITE = {"check": 1, "diff": 0, "apply": 3, "revert": 3}  # read by the writers
READ_BACKUP = {"check": 0, "diff": 0, "apply": 0, "revert": 3}
# id, the tree's kind, the plant, exit code per verb (list always 0), what the
# message names besides the tree: the plant's file and the foreign entry.
CASES = [
    pytest.param("directory", old_journal, PLAIN, [], id="old-journal-ignored"),
    pytest.param("directory", leftover_link, PLAIN, [], id="leftover-link"),
    pytest.param(
        "installed",
        link(BACKUP_DIR, lambda v: v / BACKUP_DIR),
        ALL,
        [BACKUP_DIR, "symbolic link"],
        id="backup-store-link",
    ),
    pytest.param(
        "installed",
        link(STORE, lambda v: v / STORE),
        WRITE,
        [STORE, "symbolic link"],
        id="backup-patch-folder-link",
    ),
    pytest.param(
        "installed",
        backup_then(link(f"{STORE}/{VLLM_C}", lambda v: v / "victim.txt")),
        READ_BACKUP,
        [f"{STORE}/{VLLM_C}", "symbolic link"],
        id="backup-copy-link",
    ),
    pytest.param(
        "installed",
        backup_then(foreign_manifest_entry),
        READ_BACKUP,
        ["manifest.json", "../../victim/victim.txt"],
        id="manifest-foreign-entry",
    ),
    pytest.param(
        "checkout", git_file_to("store-tree"), PLAIN, [], id="git-file-elsewhere"
    ),
    pytest.param(
        "checkout",
        link(".git", lambda v: v / BACKUP_DIR),
        PLAIN,
        [],
        id="git-is-a-link",
    ),
    pytest.param(
        "directory",
        source_elsewhere,
        ALL,
        [VLLM_C, "leads outside the tree", "victim/vllm_c.py"],
        id="source-links-out",
    ),
    pytest.param(
        "installed",
        folder_elsewhere,
        ALL,
        ["vllm/kernels", "leads outside the tree", "victim/kernels"],
        id="folder-links-out",
    ),
]


@pytest.mark.parametrize("kind,plant,codes,names", CASES)
@pytest.mark.parametrize("verb", VERBS)
def test_a_plant_changes_nothing_in_or_beside_the_tree(
    tmp_path, victim_template, monkeypatch, capsys, verb, kind, plant, codes, names
) -> None:
    victim = tmp_path / "victim"
    shutil.copytree(victim_template, victim, symlinks=True)
    tree = make_tree(tmp_path / "tree", kind)
    plant(tree, victim)
    if (
        kind == "checkout"
        and not os.path.islink(tree / ".git")
        and (tree / ".git").is_dir()
    ):
        repo = git.Repo(tree)
        repo.git.add(A=True)
        repo.index.commit("planted", author=git.Actor("t", "t@example.com"))
    monkeypatch.chdir(victim)  # a relative path must not mean the cwd
    before = snapshot(tmp_path)
    capsys.readouterr()
    argv = [verb] if verb == "list" else [verb, "--vllm", str(tree)]
    code = codes.get(verb, 0)
    assert main(argv) == code
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    if code == 0 and verb in ("apply", "revert"):  # the tree's own files change
        before = {k: v for k, v in before.items() if not k.startswith("tree/")}
        assert {
            k: v for k, v in snapshot(tmp_path).items() if k in before
        } == before
    else:
        assert snapshot(tmp_path) == before
    if code == 3:  # check reports on stdout, the others on stderr
        said = out.out + out.err
        assert verb == "check" or out.err.count("vllm-patch: error:") == 1
        assert all(name in said for name in names), said


@pytest.mark.integration  # races a process swapping a folder for seconds
def test_a_folder_swapped_for_a_link_never_leads_a_write_outside(tmp_path) -> None:
    """Issue 26's race: while apply and revert loop in this process, another
    swaps ``vllm/kernels`` for a link to an outside copy of it and back."""
    tree = make_tree(tmp_path / "tree", "installed")
    outside = tmp_path / "outside"
    shutil.copytree(tree / "vllm/kernels", outside)
    before = snapshot(outside)
    swapper = subprocess.Popen(
        [sys.executable, "-c", SWAP, str(tree), str(outside)]
    )
    codes = []
    try:
        start = time.monotonic()
        while time.monotonic() < start + (6 if 0 in codes else 60):
            codes += [
                main([verb, "--vllm", str(tree)]) for verb in ("apply", "revert")
            ]
    finally:
        swapper.kill()
        swapper.wait()
    assert snapshot(outside) == before
    assert set(codes) == {0, 3}, codes  # the race was run: some writes got through


SWAP = """
import os, sys, time
tree, outside = sys.argv[1:]
real, side = f"{tree}/vllm/kernels", f"{tree}/vllm/.kernels-real"
while True:
    os.rename(real, side)
    os.symlink(outside, real)
    os.unlink(real)
    os.rename(side, real)
    time.sleep(0.001)  # the real folder a while, so that some writes get through
"""
