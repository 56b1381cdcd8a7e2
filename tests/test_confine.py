"""A tree someone else prepared cannot turn vllm-patch against its user: a
planted intent record, backup manifest, backup link, ``.git`` file or source
link makes every command that reads the tree refuse it (exit 3, one message
naming the plant), and nothing inside the tree or beside it changes. The
victim folder beside the tree holds what each plant aims at."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import git
import pytest
from conftest import VLLM_C, make_tree, snapshot

from patcher.backup import BACKUP_DIR
from patcher.journal import JOURNAL
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


def record(op: str = "revert of cpu_fused_norms", **fields) -> dict:
    return {
        "operation": op,
        "renames": [],
        "created_folders": [],
        "remove": [],
        **fields,
    }


def rename(target: str, new: str, data: bytes = PAYLOAD) -> dict:
    return {
        "target": target,
        "new": new,
        "old": None,
        "sha256": hashlib.sha256(data).hexdigest(),
    }


Plant = Callable[[Path, Path], object]


def journal(make: Callable[[Path, Path], dict]) -> Plant:
    """A planted record: ``make(tree, victim)``."""
    return lambda tree, victim: (tree / JOURNAL).write_text(
        json.dumps(make(tree, victim))
    )


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


def fake_git_dir(tree: Path, victim: Path) -> None:
    """A folder that looks like a git dir, holding the victim's backup."""
    (victim / BACKUP_DIR / "HEAD").write_text("ref: refs/heads/main\n")
    git_file_to(BACKUP_DIR)(tree, victim)


def source_elsewhere(tree: Path, victim: Path) -> None:
    shutil.copy(tree / VLLM_C, victim / "vllm_c.py")
    link(VLLM_C, lambda v: v / "vllm_c.py")(tree, victim)


ALL = dict.fromkeys(VERBS[1:], 3)
READ_BACKUP = {"check": 0, "diff": 0, "apply": 0, "revert": 3}
# id, the tree's kind, the plant, exit code per verb (list always 0), what the
# message names besides the tree: the plant's file and the foreign entry.
CASES = [
    pytest.param("directory", journal(lambda t, v: record(remove=[str(v)])), ALL,
                 [JOURNAL, "folder to remove", "victim"], id="journal-remove-outside"),
    pytest.param("directory", journal(lambda t, v: record(remove=["."])), ALL,
                 [JOURNAL, "folder to remove '.'"], id="journal-remove-cwd"),
    pytest.param("directory", journal(lambda t, v: record(remove=["../victim"])), ALL,
                 [JOURNAL, "'../victim'"], id="journal-remove-relative"),
    pytest.param("directory", journal(lambda t, v: record(renames=[
        rename(str(v / "victim.txt"), str(v / "payload"))])), ALL,
                 [JOURNAL, "target", "victim.txt"], id="journal-rename-outside"),
    pytest.param("directory", journal(lambda t, v: record(renames=[
        rename("../../victim/victim.txt", "../../victim/payload")])), ALL,
                 [JOURNAL, "'../../victim/victim.txt'"], id="journal-dotdot-target"),
    pytest.param("directory", journal(lambda t, v: record(renames=[
        rename(str(t / VLLM_C), str(v / "victim.txt"))])), ALL,
                 [JOURNAL, "new", "victim.txt"], id="journal-new-outside"),
    pytest.param("directory", lambda t, v: (
        (t / "through").symlink_to(v),
        journal(lambda t, v: record(renames=[
            rename(str(t / "through" / "victim.txt"), str(t / "through" / "payload"))
        ]))(t, v)), ALL, [JOURNAL, "through/victim.txt"], id="journal-through-link"),
    pytest.param("directory", journal(lambda t, v: record(
        created_folders=[str(v / "empty")])), ALL,
                 [JOURNAL, "created folder"], id="journal-created-outside"),
    pytest.param("directory", journal(lambda t, v: record(op="apply of nope", renames=[
        rename(str(t / VLLM_C), str(t / "vllm/kernels/.vllm_c.py.vllm-patch.new"))])),
                 ALL, [JOURNAL, "apply of nope"], id="journal-unknown-patch"),
    pytest.param("directory", link(JOURNAL, lambda v: v / "victim.txt"), ALL,
                 [JOURNAL, "a symbolic link"], id="journal-is-a-link"),
    pytest.param("installed", link(BACKUP_DIR, lambda v: v / BACKUP_DIR), ALL,
                 [BACKUP_DIR, "symbolic link", "victim"], id="backup-store-link"),
    pytest.param("installed", link(STORE, lambda v: v / STORE), ALL,
                 [STORE, "symbolic link"], id="backup-patch-folder-link"),
    pytest.param("installed", backup_then(link(f"{STORE}/{VLLM_C}",
                 lambda v: v / "victim.txt")), READ_BACKUP,
                 [f"{STORE}/{VLLM_C}", "symbolic link"], id="backup-copy-link"),
    pytest.param("installed", backup_then(foreign_manifest_entry), READ_BACKUP,
                 ["manifest.json", "../../victim/victim.txt"],
                 id="manifest-foreign-entry"),
    pytest.param("checkout", git_file_to("store-tree"), ALL,
                 [".git", "not a git directory of it"], id="git-file-elsewhere"),
    pytest.param("checkout", fake_git_dir, ALL,
                 [".git", "not a git directory of it"], id="git-file-fake-git-dir"),
    pytest.param("checkout", link(".git", lambda v: v / BACKUP_DIR), ALL,
                 [".git", "a symbolic link"], id="git-is-a-link"),
    pytest.param("directory", source_elsewhere, ALL,
                 [VLLM_C, "leads outside the tree", "victim/vllm_c.py"],
                 id="source-links-out"),
]  # fmt: skip


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
    assert main(argv) == codes.get(verb, 0)
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    assert snapshot(tmp_path) == before
    if codes.get(verb, 0) == 3:  # check reports on stdout, the others on stderr
        said = out.out + out.err
        assert verb == "check" or out.err.count("vllm-patch: error:") == 1
        assert all(name in said for name in names), said
