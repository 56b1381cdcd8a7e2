"""A kill or a failing system call during apply or revert, injected from
outside by strace: every file then holds its old or its new bytes, ``check``
says which state the tree is in, the next ``apply`` gives the applied tree and
``revert`` the original bytes. And one writer at a time: a second waits, says
so once, and a reader never sees a write half done."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CPU, VLLM_C, make_tree, snapshot

from patcher.backup import BACKUP_DIR
from patcher.files import NEW, locked
from vllm_patch.cli import main

START = {"apply": "original", "revert": "patched"}
needs_strace = pytest.mark.skipif(shutil.which("strace") is None, reason="strace")


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


def sources(state: dict[str, bytes]) -> dict[str, bytes]:
    return {rel: state[rel] for rel in (VLLM_C, CPU)}


def check_word(tree: Path, capsys) -> str:
    assert main(["check", "--json", "--vllm", str(tree)]) in (0, 1)
    return json.loads(capsys.readouterr().out)[0]["status"]


def strace(tree: Path, verb: str, inject: str) -> subprocess.CompletedProcess:
    """``vllm-patch VERB`` under strace, which injects ``inject`` (its own
    syntax: ``CALL:what:when=N``) at the system calls it names; no .pyc written,
    so that only the command's own calls count. ``injected`` on the result:
    whether strace did inject (the command made an N-th such call)."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    log = tree.parent / "strace.log"
    call = inject.split(":", 1)[0]
    command = ["strace", "-f", "-qq", "-o", str(log), "-e", f"trace={call}"]
    command += ["-e", f"inject={inject}"]
    command += [sys.executable, "-m", "vllm_patch", verb, "--vllm", str(tree)]
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=120
    )
    done.injected = "(INJECTED)" in log.read_text()
    return done


def assert_recovers(tree: Path, states, capsys) -> None:
    """Each source is old or new; check names the state; apply then revert
    give the two whole states, with nothing left over."""
    now = sources(snapshot(tree))
    old, new = sources(states["original"]), sources(states["patched"])
    assert all(now[rel] in (old[rel], new[rel]) for rel in now), now
    expected = {
        (True, True): "applied",
        (False, False): "applicable",
    }.get(tuple(now[rel] == new[rel] for rel in now), "partly applied")
    assert check_word(tree, capsys) == expected
    assert main(["apply", "--vllm", str(tree)]) == 0
    assert snapshot(tree) == states["patched"]
    assert main(["revert", "--vllm", str(tree)]) == 0
    assert snapshot(tree) == states["original"]
    capsys.readouterr()


@pytest.mark.integration
@needs_strace
@pytest.mark.parametrize("verb", ["apply", "revert"])
def test_a_kill_at_any_write_leaves_old_or_new_bytes(
    tmp_path, states, capsys, verb
):
    """SIGKILL at the N-th rename of the command, for every N: just before each
    file changes (its new bytes written and synced beside it)."""
    call = "renameat"
    tree = tmp_path / "tree"
    for n in range(1, 20):
        put(tree, states[START[verb]])
        done = strace(tree, verb, f"{call}:signal=KILL:when={n}")
        if done.returncode != -9 and "Killed" not in done.stderr:
            assert done.returncode == 0, done.stderr
            break
        assert_recovers(tree, states, capsys)
    assert n > 2, "the command was never killed"


# strace makes the N-th real system call of a class fail with an error: each
# verb with the calls it makes (apply creates the backup's folder and deletes
# nothing; revert deletes the backup and creates no folder).
VERB_FAULTS = [
    ("apply", "write", "ENOSPC"),
    ("apply", "fsync", "EIO"),
    ("apply", "renameat", "EXDEV"),
    ("apply", "mkdirat", "ENOSPC"),
    ("revert", "write", "ENOSPC"),
    ("revert", "fsync", "EIO"),
    ("revert", "renameat", "EXDEV"),
    ("revert", "unlinkat", "EIO"),
]


@pytest.mark.integration
@pytest.mark.slow  # a sweep: every call of each class, both verbs
@needs_strace
@pytest.mark.parametrize("verb,calls,error", VERB_FAULTS)
def test_a_failed_call_is_one_message_and_recoverable(
    tmp_path, states, capsys, verb, calls, error
):
    tree = tmp_path / "tree"
    fired = 0
    for n in range(1, 30):
        put(tree, states[START[verb]])
        done = strace(tree, verb, f"{calls}:error={error}:when={n}")
        if not done.injected:  # the command makes fewer than n such calls
            break
        fired += 1
        assert "Traceback" not in done.stderr, done.stderr
        if done.returncode == 3:
            assert done.stderr.count("vllm-patch: error:") == 1, done.stderr
        else:
            assert done.returncode == 0, done.stderr
        assert_recovers(tree, states, capsys)
    assert fired, f"{verb} made no {calls} call for strace to fail"


@pytest.mark.integration
@needs_strace
def test_an_io_error_between_two_files_says_how_far_it_got(
    tmp_path, states, capsys
):
    """The fourth rename of apply is the second source (two backup copies and
    the manifest first): the message names it and says what to do."""
    tree = tmp_path / "tree"
    put(tree, states["original"])
    done = strace(tree, "apply", "renameat:error=EIO:when=5")
    assert done.returncode == 3, done.stderr
    assert "1 of 2 files written" in done.stderr and "apply again" in done.stderr
    assert_recovers(tree, states, capsys)


@pytest.mark.integration
@needs_strace
def test_a_full_disk_before_any_file_is_written_says_nothing_changed(
    tmp_path, states, capsys
):
    """The first write of apply is the first backup copy's: refused, it leaves
    the tree as it was, and the message says so."""
    tree = tmp_path / "tree"
    put(tree, states["original"])
    done = strace(tree, "apply", "write:error=ENOSPC:when=1")
    assert done.returncode == 3, done.stderr
    assert "No space left on device" in done.stderr
    assert "nothing was changed" in done.stderr and "partly" not in done.stderr
    assert sources(snapshot(tree)) == sources(states["original"])
    assert_recovers(tree, states, capsys)


def test_leftovers_of_a_killed_write_go_with_the_next_apply(tree, capsys) -> None:
    leftover = tree / "vllm/kernels" / f".vllm_c.py.0123456789ab{NEW}"
    leftover.write_text("half")
    assert main(["apply", "--vllm", str(tree)]) == 0
    assert not leftover.exists()


def test_a_half_applied_tree_is_reported_then_finished(tree, tmp_path, capsys):
    patched = tmp_path / "patched"
    shutil.copytree(tree, patched)
    assert main(["apply", "--vllm", str(patched)]) == 0
    shutil.copy(patched / CPU, tree / CPU)
    capsys.readouterr()
    assert check_word(tree, capsys) == "partly applied"
    assert main(["check", "--vllm", str(tree)]) == 1
    assert main(["apply", "--vllm", str(tree)]) == 0
    assert sources(snapshot(tree)) == sources(snapshot(patched))


def holding_the_lock(tree: Path, seconds: float, write=None, shared=False) -> int:
    """A forked process that holds ``tree``'s lock for ``seconds`` (calling
    ``write`` half-way); returns once it holds it."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            with locked(tree, shared=shared):
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
    from patcher import files

    files._waited.clear()
    pid = holding_the_lock(tree, 0.3)
    main([verb, "--vllm", str(tree)])
    err = capsys.readouterr().err
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    line = f"vllm-patch: waiting for another vllm-patch on {tree}"
    assert err.count("waiting for") == 1 and line in err, err


def test_readers_do_not_wait_for_each_other(tree, capsys) -> None:
    pid = holding_the_lock(tree, 0.3, shared=True)
    assert main(["check", "--vllm", str(tree)]) == 1
    os.waitpid(pid, 0)
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


@pytest.mark.integration  # concurrent CLI processes
@pytest.mark.parametrize("n", [2])
def test_concurrent_runs_apply_once_and_revert_exactly(installed, n, capfd) -> None:
    original = snapshot(installed)
    for verb, want in (("apply", None), ("revert", original)):
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "vllm_patch", verb, "--vllm", str(installed)]
            )
            for _ in range(n)
        ]
        assert [p.wait() for p in procs] == [0] * n
        if want is not None:
            assert snapshot(installed) == want
    assert not (installed / BACKUP_DIR).exists()
