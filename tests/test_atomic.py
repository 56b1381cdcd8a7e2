"""Faults and locks around the all-or-nothing write, on the small installed
fixture tree: every failure leaves a message that is true about the tree
(untouched, restored, or partly written and finished or undone by the next
command), a kill followed by a fault in the recovery never leaves a mixed tree
called rolled back, readers wait for writers and say so."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CPU, VLLM_C, make_tree, snapshot

from patcher import atomic, engine
from patcher.atomic import FAULT_ENV, JOURNAL
from patcher.backup import BACKUP_DIR
from patcher.journal import NEW, OLD, sibling
from patcher.patchset import select
from patcher.tree import open_tree
from vllm_patch.cli import main

PATCH = select(["cpu_fused_norms"])[0]
START = {"apply": "original", "revert": "patched"}
SYSCALL = re.compile(r"\b(open|read|write|fsync|rename|link|unlink|mkdir|rmdir)\b")


@pytest.fixture(scope="module")
def states(tmp_path_factory) -> dict[str, dict[str, bytes]]:
    """The installed fixture tree's two whole states, as ``snapshot`` gives them."""
    tree = make_tree(tmp_path_factory.mktemp("states") / "tree", "installed")
    original = snapshot(tree)
    assert main(["apply", "--vllm", str(tree)]) == 0
    return {"original": original, "patched": snapshot(tree)}


def put(tree: Path, state: dict[str, bytes]) -> None:
    """Make ``tree`` hold ``state`` (folders and files), nothing else."""
    shutil.rmtree(tree, ignore_errors=True)
    for rel, data in sorted(state.items()):
        path = tree / rel
        if data == b"folder":
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)


def whole(tree: Path, states) -> str | None:
    now = snapshot(tree)
    found = next((name for name, s in states.items() if s == now), None)
    if found is None:  # say how it differs, for the assertion that follows
        for name, s in states.items():
            diff = sorted(k for k in set(now) | set(s) if now.get(k) != s.get(k))
            print(f"differs from {name}: {diff}")
    return found


def command(argv: list[str], capsys, fault: str | None = None) -> tuple[int, str]:
    """``main(argv)`` with ``fault`` injected (see ``atomic.FAULT_ENV``)."""
    atomic._steps.clear()
    if fault:
        os.environ[FAULT_ENV] = fault
    try:
        code = main(argv)
    finally:
        os.environ.pop(FAULT_ENV, None)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def assert_true_to_the_tree(tree, states, verb, code, err, capsys) -> str:
    """What the failed (or not) command said holds: the tree is whole now,
    or the message says the next command deals with it, and it does."""
    state = whole(tree, states)
    if code == 0:
        assert state is not None, err
        assert state == {"apply": "patched", "revert": "original"}.get(verb, state)
        return "done"
    assert code == 3, err
    assert str(tree) in err and SYSCALL.search(err), err
    if "next vllm-patch command" in err:
        assert main(["check", "--vllm", str(tree)]) in (0, 1)
        capsys.readouterr()
        assert whole(tree, states) is not None, err
        return "left for the next command"
    assert "rolled back" not in err or state is not None, err
    if "nothing was changed" in err or "restored" in err:
        assert state == START.get(verb, state), err
    assert state is not None, err
    return "whole"


KINDS = ["write", "fsync", "rename", "link", "unlink", "mkdir", "rmdir"]


@pytest.mark.parametrize(
    "verb,fault,says,state",
    [
        pytest.param("apply", "fsync:1:EIO", "nothing was changed", "original",
                     id="record-not-synced"),
        pytest.param("apply", "write:3:EIO", "nothing was changed", "original",
                     id="a-new-file-not-written"),
        pytest.param("apply", "rename:3:EIO", "every file was restored", "original",
                     id="second-rename"),
        pytest.param("revert", "rmdir:1:EIO", "next vllm-patch command", None,
                     id="backup-folder-not-deleted"),
        pytest.param("revert", "unlink:1:EIO", "next vllm-patch command", None,
                     id="old-name-not-deleted"),
    ],
)  # fmt: skip
def test_a_failed_step_is_told_truly(
    tmp_path, states, capsys, verb, fault, says, state
):
    tree = tmp_path / "tree"
    put(tree, states[START[verb]])
    code, err = command([verb, "--vllm", str(tree)], capsys, fault)
    assert code == 3 and says in err, err
    assert whole(tree, states) == state
    assert assert_true_to_the_tree(tree, states, verb, code, err, capsys)


@pytest.mark.integration
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("verb", ["apply", "revert"])
def test_an_error_at_any_step_is_told_truly(tmp_path, states, capsys, verb, kind):
    """An ``EIO`` at the N-th step of a kind, for every N the command reaches."""
    tree = tmp_path / "tree"
    said = set()
    for n in range(1, 40):
        put(tree, states[START[verb]])
        code, err = command([verb, "--vllm", str(tree)], capsys, f"{kind}:{n}:EIO")
        if code == 0:  # the step was never reached
            break
        said.add(assert_true_to_the_tree(tree, states, verb, code, err, capsys))
    assert n > 1 or (verb, kind) in NEVER, "the fault point was never reached"


# Steps these commands do not take (apply deletes no folder, revert creates
# none), or whose failure is absorbed (no hard link: the .old is a copy).
NEVER = {("apply", "rmdir"), ("revert", "mkdir"), ("revert", "link"), ("apply", "link")}


def run_killed(tree: Path, verb: str, step: int) -> bool:
    """``verb`` in a child SIGKILLed at its ``step``-th step; was it killed?"""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.environ[FAULT_ENV] = str(step)
            atomic._steps.clear()
            {"apply": engine.apply, "revert": engine.revert}[verb](
                open_tree(tree), PATCH
            )
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status)


@pytest.mark.integration
@pytest.mark.slow  # every step twice over: minutes; `-m slow` runs it
@pytest.mark.parametrize("verb", ["apply", "revert"])
def test_a_kill_then_a_fault_in_recovery(tmp_path, states, capsys, verb) -> None:
    """Killed at step K, then the next command fails at its J-th step (EIO)
    while recovering: what it says is true, and the command after it leaves a
    whole tree. Never a mixed tree called rolled back."""
    tree = tmp_path / "tree"
    told = set()
    for kill in range(1, 60):
        put(tree, states[START[verb]])
        if not run_killed(tree, verb, kill):
            break
        for fault in range(1, 12):
            put(tree, states[START[verb]])
            assert run_killed(tree, verb, kill)
            code, err = command(["check", "--vllm", str(tree)], capsys, f"{fault}:EIO")
            if code != 3:  # recovered without meeting the fault
                assert whole(tree, states) is not None
                break
            told.add(assert_true_to_the_tree(tree, states, "check", code, err, capsys))
    assert kill > 5 and told


def holding_the_lock(tree: Path, seconds: float, write=None) -> int:
    """A child process that holds the tree's write lock for ``seconds``
    (calling ``write()`` half-way); its pid, once it holds it."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            with atomic.locked(tree):
                os.write(ready_w, b"x")
                time.sleep(seconds / 2)
                if write:
                    write()
                time.sleep(seconds / 2)
        except BaseException:
            code = 1
        os._exit(code)
    os.read(ready_r, 1)
    os.close(ready_r)
    os.close(ready_w)
    return pid


@pytest.mark.parametrize("verb", ["check", "diff", "apply", "revert"])
def test_a_waiting_command_says_so_once(tree, capsys, verb) -> None:
    atomic._waited.clear()
    pid = holding_the_lock(tree, 0.3)
    main([verb, "--vllm", str(tree)])
    err = capsys.readouterr().err
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    line = f"vllm-patch: waiting for another vllm-patch on {tree} (pid {pid})"
    assert err.count("waiting for") == 1 and line in err, err


def test_readers_do_not_wait_for_each_other(tree, capsys) -> None:
    atomic._waited.clear()
    with atomic.locked(tree, shared=True):
        assert main(["check", "--vllm", str(tree)]) == 1
    assert "waiting" not in capsys.readouterr().err


@pytest.mark.parametrize("verb", ["check", "diff"])
def test_a_reader_never_sees_a_write_half_done(tree, tmp_path, capsys, verb):
    """A writer replaces one file, then (0.1 s later) the other, under the
    lock: the reader waits, and reports both patched."""
    patched = tmp_path / "patched"
    shutil.copytree(tree, patched)
    assert main(["apply", "--vllm", str(patched)]) == 0

    def write() -> None:
        for rel in (VLLM_C, CPU):
            os.replace(shutil.copy(patched / rel, tree / f"{rel}.x"), tree / rel)
            time.sleep(0.1)

    pid = holding_the_lock(tree, 0.4, write)
    capsys.readouterr()
    code = main([verb, "--vllm", str(tree)])
    out = capsys.readouterr()
    os.waitpid(pid, 0)
    assert code == 0, out.out + out.err
    assert "already applied" in out.err if verb == "diff" else "applied" in out.out


# What the kernel does, not the fault hook: strace makes the N-th real system
# call of a class fail, on the files of the tree only (-P).
STRACE_FAULTS = [
    ("write", "ENOSPC"),
    ("fsync,fdatasync", "EIO"),
    ("unlink,unlinkat", "EIO"),
    ("rmdir,unlinkat", "EIO"),
    ("rename,renameat,renameat2", "EXDEV"),
    # Every open refused: the command's own imports too, so it runs slowly.
    pytest.param("openat", "EMFILE", marks=pytest.mark.slow),
    ("mkdir,mkdirat", "ENOSPC"),
]


def tree_paths(tree: Path, states) -> list[Path]:
    """Every path a command may touch in the tree: all names in either state,
    their .new/.old names, the record and its .new."""
    rels = set(states["original"]) | set(states["patched"])
    paths = [tree, tree / JOURNAL, tree / f"{JOURNAL}.vllm-patch.new"]
    for rel in sorted(rels):
        path = tree / rel
        paths += [path, sibling(path, NEW), sibling(path, OLD)]
    return paths + [tree / BACKUP_DIR]


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
@pytest.mark.parametrize("calls,error", STRACE_FAULTS)
@pytest.mark.parametrize("verb", ["apply", "revert"])
def test_strace_faults_are_told_truly(tmp_path, states, capsys, verb, calls, error):
    tree = tmp_path / "tree"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env.pop(FAULT_ENV, None)
    log = tmp_path / "strace.log"
    paths = [a for p in tree_paths(tree, states) for a in ("-P", str(p))]
    told = set()
    for n in range(1, 60):
        put(tree, states[START[verb]])
        proc = subprocess.run(
            ["strace", "-f", "-qq", "-o", str(log), *paths,
             "-e", f"inject={calls}:error={error}:when={n}",
             sys.executable, "-m", "vllm_patch", verb, "--vllm", str(tree)],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if "INJECTED" not in log.read_text():
            break
        assert "Traceback" not in proc.stderr, proc.stderr
        told.add(
            assert_true_to_the_tree(
                tree, states, verb, proc.returncode, proc.stderr, capsys
            )
        )
    never = (verb, calls.split(",")[0]) in {("apply", "rmdir"), ("revert", "mkdir")}
    assert n > 1 or never, "no call of this class was ever made"
