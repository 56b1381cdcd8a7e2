"""All-or-nothing writes across several files, whole even after a SIGKILL.

The rule that keeps hard-linked copies safe: **every write is a rename of a new
file, never an in-place write.** No existing file is opened for writing: new bytes
go to a new file beside the target, which is then renamed over it; a rename changes
what a name points to and never writes through another name of the same inode.
``tree.linked_copy`` shares inodes with the install it copies and relies on this;
so does the ``.old`` name below.

The protocol, the way git and package managers make a multi-file write survive a
kill at any instruction:

1. Writes happen under an exclusive ``flock`` on the tree root (the kernel drops
   it when its holder dies), so one writer at a time; ``check`` and ``diff`` read
   under a shared one, so they never see a write half done.
2. An intent record (``journal``) is written, fsynced and renamed into place
   before anything else. It names every rename to make (the new file, its
   target, the SHA-256 of the new bytes, the ``.old`` name that keeps the
   replaced file), the folders it creates and the folders to delete once the
   renames are done (a discarded backup). Every path in it is checked against
   the operation's ``Scope`` first, written or read.
3. Each new content is written to ``.<name>.vllm-patch.new`` beside its target and
   fsynced; each replaced file gets a second name, ``.<name>.vllm-patch.old``.
4. The ``.new`` files are renamed over their targets, then the clean-up: the
   folders deleted, the ``.old`` names and the record removed.

``recover`` runs before every command: with a record present, the operation is
finished when every new file is complete (still waiting under its ``.new`` name,
or already renamed, by its hash), and rolled back otherwise. A rename that fails
(in-process, or while finishing) rolls back by renaming ``.old`` back; once every
rename is made the operation is only ever finished, never rolled back (the
clean-up may have deleted the backup). Whatever fails is reported with its system
call and file, and with what the tree holds now: untouched, restored, or partly
written with its record kept, which the next command finishes or rolls back.
Without a record, files with the names above beside the operation's files are
leftovers, deleted.

Tests inject a SIGKILL (or an ``OSError``) at any step through ``FAULT_ENV``.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import signal
import stat
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from patcher.confine import real
from patcher.errors import PatchError, ReadError, shown
from patcher.files import MAX_FILE_BYTES, kind, read_regular
from patcher.journal import (
    JOURNAL,
    NEW,
    OLD,
    Scope,
    check_record,
    names,
    read_record,
    sibling,
)

WRITE_BITS = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH

FAULT_ENV = "VLLMPATCH_FAULT"
"""For tests only: ``N`` or ``KIND:N`` (KIND one of fsync, rename, link, unlink,
mkdir, rmdir, write, open: a folder listed) SIGKILLs this process just before
its N-th such step; ``KIND:N:EIO`` raises that ``OSError`` there instead."""
_steps: dict[str, int] = {}


def _step(kind: str) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    parts = spec.split(":")
    if parts[0].isdigit():
        parts.insert(0, "any")
    want, count = parts[0], int(parts[1])
    if want not in ("any", kind):
        return
    _steps[want] = _steps.get(want, 0) + 1
    if _steps[want] != count:
        return
    if len(parts) > 2:
        code = getattr(errno, parts[2])
        raise OSError(code, os.strerror(code))
    os.kill(os.getpid(), signal.SIGKILL)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class SyscallError(OSError):
    """An ``OSError`` that knows its system call and file, for the message."""

    def __init__(self, exc: OSError, call: str, path: Path) -> None:
        super().__init__(exc.errno, exc.strerror or str(exc), str(path))
        self.call = call


@contextmanager
def _syscall(call: str, path: Path) -> Iterator[None]:
    """Run one step that changes the file system; an error names ``call``."""
    try:
        _step(call)
        yield
    except SyscallError:
        raise
    except OSError as exc:
        raise SyscallError(exc, call, path) from exc


def what_failed(exc: OSError | PatchError) -> str:
    """``rename /t/x: Input/output error``, for a message."""
    if isinstance(exc, PatchError):
        return f"{exc.path}: {exc.message}"
    call = getattr(exc, "call", None)
    where = shown(exc.filename) if exc.filename else ""
    return " ".join(filter(None, [call, where])) + f": {exc.strerror or exc}"


# The only calls that change the file system, each a fault point.
def _fsync_dir(path: Path) -> None:
    with _syscall("fsync", path):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """A fresh file (never through an existing name or link), synced."""
    _unlink(path)
    with _syscall("write", path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with _syscall("write", path):
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, mode)
        with _syscall("fsync", path):
            os.fsync(fd)
    finally:
        os.close(fd)


def _rename(src: Path, dst: Path) -> None:
    with _syscall("rename", src):
        os.replace(src, dst)


def _link(src: Path, dst: Path) -> None:
    with _syscall("link", dst):
        os.link(src, dst, follow_symlinks=False)


def _unlink(path: Path) -> None:
    if os.path.lexists(path):
        with _syscall("unlink", path):
            os.unlink(path)


def _mkdir(path: Path) -> None:
    with _syscall("mkdir", path):
        os.mkdir(path)


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _listdir(path: Path) -> list[str]:
    with _syscall("open", path):
        return sorted(os.listdir(path))


def _rmdir_if_empty(path: Path) -> None:
    if _is_real_dir(path) and not _listdir(path):
        with _syscall("rmdir", path):
            os.rmdir(path)


def _rmtree(path: Path) -> None:
    """Delete ``path``; a folder with what it holds, never following a link."""
    if _is_real_dir(path):
        for child in _listdir(path):
            _rmtree(path / child)
        with _syscall("rmdir", path):
            os.rmdir(path)
    else:
        _unlink(path)


def _clear(folder: Path, scope: Scope) -> None:
    """Delete the scope's files in ``folder`` (a folder in the place of one: a
    damaged backup), then the folders left empty: anything else vllm-patch
    would not have made there stays, and keeps its folder."""
    if _is_real_dir(folder):
        for path in sorted(p for p in scope.files if p.is_relative_to(folder)):
            _rmtree(path)
        _prune(folder)
    _rmdir_if_empty(folder.parent)  # the store, once it holds no patch's backup


def _prune(folder: Path) -> None:
    """Delete the empty folders in ``folder``, deepest first, then itself if
    that leaves it empty; never following a link."""
    for name in _listdir(folder):
        if _is_real_dir(folder / name):
            _prune(folder / name)
    _rmdir_if_empty(folder)


# Checks made before anything is written.
def check_writable(path: Path) -> None:
    """Refuse files and folders marked read-only, even when running as root
    (who could write them anyway: a read-only mark is a request to leave it)."""
    target = path
    while not os.path.lexists(target):
        target = target.parent
    mode = target.stat().st_mode
    if not os.access(target, os.W_OK) or not mode & WRITE_BITS:
        what = "folder" if target.is_dir() else "file"
        raise PatchError(
            f"{what} is read-only",
            path=str(target),
            looked_for=f"a writable {what}",
            found=f"mode {stat.filemode(mode)}",
        )


def _refuse_non_regular(path: Path) -> None:
    if os.path.lexists(path) and not path.is_file():
        raise PatchError(
            "not a regular file",
            path=str(path),
            looked_for="a regular file to replace",
            found=kind(os.lstat(path).st_mode),
        )


# The lock.
_waited: set[Path] = set()


@contextmanager
def locked(root: Path, *, shared: bool = False) -> Iterator[None]:
    """One writer at a time on a tree, or readers beside each other (``shared``);
    not re-entrant. Waiting is said once per tree, on stderr."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        how = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
        except BlockingIOError:
            if root not in _waited:
                _waited.add(root)
                holder = _holder(fd)
                pid = f" (pid {holder})" if holder else ""
                print(
                    f"vllm-patch: waiting for another vllm-patch on {shown(root)}{pid}",
                    file=sys.stderr,
                    flush=True,
                )
            fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)  # releases the lock


def _holder(fd: int) -> int | None:
    """The process holding a ``flock`` on ``fd``'s file, from ``/proc/locks``
    (Linux; None elsewhere or when it is gone)."""
    st = os.fstat(fd)
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if "->" not in fields and len(fields) > 5 and fields[5] == device:
            return int(fields[4]) if fields[4].isdigit() else None
    return None


# The intent record.
def _record_new(root: Path) -> Path:
    return root / (JOURNAL + NEW)


def _write_record(root: Path, record: dict) -> None:
    path = root / JOURNAL
    new = _record_new(root)
    _write_new(new, (json.dumps(record, indent=1) + "\n").encode(), 0o644)
    _rename(new, path)
    _fsync_dir(root)


def _drop_record(root: Path) -> None:
    _unlink(root / JOURNAL)
    _fsync_dir(root)


def write_atomically(
    root: Path,
    files: dict[Path, bytes],
    scope: Scope,
    *,
    remove: list[Path] | tuple[Path, ...] = (),
    label: str = "write",
) -> None:
    """Replace (or create) every file in ``files``, then delete the folders in
    ``remove``; all of it or, on an error, none (or a message that says what is
    left, and that the next command finishes or undoes it). Every path must lie
    in ``scope``. ``root`` holds the intent record; the caller holds
    ``locked(root)``."""
    targets = {real(p): data for p, data in files.items()}
    record = _record_of(label, targets, remove)
    check_record(record, scope)
    for path in [root, *targets, *{t.parent for t in targets}]:
        check_writable(path)
    for path in targets:
        _refuse_non_regular(path)
    try:
        _write_record(root, record)
        for folder in record["created_folders"]:
            _mkdir(Path(folder))
        for entry, data in zip(record["renames"], targets.values(), strict=True):
            _prepare(entry, data)
    except (OSError, ReadError) as exc:  # ReadError: a file to keep as .old
        raise _undone(root, record, "cannot write", exc) from exc
    try:
        _rename_all(record)
    except OSError as exc:
        raise _undone(root, record, "cannot replace", exc) from exc
    try:
        _clean_up(root, record, scope)
    except OSError as exc:
        raise _unfinished(root, record, exc) from exc


def _record_of(label: str, targets: dict[Path, bytes], remove) -> dict:
    renames = [
        {
            "target": str(path),
            "new": str(sibling(path, NEW)),
            "old": str(sibling(path, OLD)) if os.path.lexists(path) else None,
            "sha256": sha256(data),
        }
        for path, data in targets.items()
    ]
    return {
        "operation": label,
        "renames": renames,
        "created_folders": [str(p) for p in _missing_parents(targets)],
        "remove": [str(p) for p in remove],
    }


def _prepare(entry: dict, data: bytes) -> None:
    target = Path(entry["target"])
    mode = stat.S_IMODE(target.stat().st_mode) if entry["old"] else 0o600
    _write_new(Path(entry["new"]), data, mode)
    if entry["old"]:
        _keep_old(target, Path(entry["old"]))


def _files(record: dict) -> str:
    return ", ".join(shown(e["target"]) for e in record["renames"]) or "no file"


def _undone(
    root: Path, record: dict, what: str, exc: OSError | PatchError
) -> PatchError:
    """Roll back after ``exc``; the error that says how that went."""
    where = exc.path if isinstance(exc, PatchError) else exc.filename
    renamed = None
    try:
        renamed = _renamed(record)
        _roll_back(root, record)
    except (OSError, ReadError) as second:
        left = (
            f"{_files(record)} unchanged, but files it wrote are left; the "
            "next vllm-patch command on this tree deletes them"
            if renamed == []
            else "the tree may be partly written; its record is kept, and the "
            "next vllm-patch command on this tree finishes or rolls it back"
        )
        return PatchError(
            f"{what} ({what_failed(exc)}), and undoing it failed "
            f"({what_failed(second)}): {left}",
            path=where or str(root),
        )
    done = "every file was restored" if renamed else "nothing was changed"
    return PatchError(f"{what} ({what_failed(exc)}); {done}", path=where)


def _unfinished(root: Path, record: dict, exc: OSError) -> PatchError:
    """The error for a clean-up that failed after every rename was made."""
    if os.path.lexists(root / JOURNAL):
        left = (
            "every file is written; the clean-up is left, and the next "
            "vllm-patch command on this tree finishes it (its record is kept)"
        )
    else:
        left = "every file is written and the record removed, but not synced"
    return PatchError(
        f"cannot finish {record['operation']} ({what_failed(exc)}): {left}",
        path=exc.filename or str(root),
    )


def _missing_parents(targets) -> list[Path]:
    created: list[Path] = []
    for path in targets:
        missing = []
        parent = path.parent
        while not os.path.lexists(parent):
            missing.append(parent)
            parent = parent.parent
        created += [p for p in reversed(missing) if p not in created]
    return created


def _keep_old(target: Path, old: Path) -> None:
    """A second name for the file about to be replaced (a copy where the file
    system refuses the link), so a failed rename can be undone."""
    _unlink(old)
    try:
        _link(target, old)
    except OSError:
        _write_new(old, read_regular(target), stat.S_IMODE(target.stat().st_mode))


def _hash(path: Path) -> str | None:
    """The SHA-256 of a regular file (never blocking on a FIFO), else None."""
    try:
        return sha256(read_regular(path, limit=MAX_FILE_BYTES))
    except ReadError:  # the system's trouble, not the file's: decide nothing
        raise
    except PatchError:
        return None


def _is_renamed(entry: dict) -> bool:
    return not os.path.lexists(entry["new"]) and (
        _hash(Path(entry["target"])) == entry["sha256"]
    )


def _is_ready(entry: dict) -> bool:
    if not os.path.lexists(entry["new"]):
        return _is_renamed(entry)
    return _hash(Path(entry["new"])) == entry["sha256"]


def _rename_all(record: dict) -> None:
    for entry in record["renames"]:
        if os.path.lexists(entry["new"]):
            _rename(Path(entry["new"]), Path(entry["target"]))


def _clean_up(root: Path, record: dict, scope: Scope) -> None:
    for folder in sorted({Path(e["target"]).parent for e in record["renames"]}):
        _fsync_dir(folder)
    for folder in record["remove"]:
        _clear(Path(folder), scope)
    for entry in record["renames"]:
        if entry["old"]:
            _unlink(Path(entry["old"]))
    _drop_record(root)


def _can_roll_back(record: dict) -> bool:
    """Does every renamed file still have its ``.old`` (or had none)?"""
    return all(
        not e["old"] or os.path.lexists(e["old"])
        for e in record["renames"]
        if _is_renamed(e)
    )


def _renamed(record: dict) -> list[dict]:
    """The entries already renamed over their targets (read before acting)."""
    return [e for e in record["renames"] if _is_renamed(e)]


def _roll_back(root: Path, record: dict) -> None:
    renamed = _renamed(record)  # every read made before the first change
    for entry in reversed(record["renames"]):
        target, new = Path(entry["target"]), Path(entry["new"])
        old = Path(entry["old"]) if entry["old"] else None
        if entry in renamed:
            if old is not None and os.path.lexists(old):
                _rename(old, target)
            elif old is None:
                _unlink(target)
        _unlink(new)
        if old is not None:
            _unlink(old)
    for folder in reversed(record["created_folders"]):
        _rmdir_if_empty(Path(folder))
    _unlink(_record_new(root))  # a record that failed while being written
    _drop_record(root)


# Recovery.
def pending(root: Path, scope: Scope) -> bool:
    """Is there an interrupted operation (or a leftover) to deal with?"""
    if os.path.lexists(root / JOURNAL) or os.path.lexists(_record_new(root)):
        return True
    return any(_leftovers(scope))


def recover(root: Path, scope: Scope, scope_of: Callable[[str], Scope]) -> list[str]:
    """Finish or roll back an interrupted operation on ``root`` (its record
    checked against ``scope_of(the patch it names)``), then delete leftovers
    of ``scope``'s files; what was done, one line each. The caller holds
    ``locked(root)``."""
    notes: list[str] = []
    journal = root / JOURNAL
    try:
        if os.path.lexists(_record_new(root)):  # a record never completed
            _unlink(_record_new(root))
            notes.append(f"deleted {shown(_record_new(root))}, an interrupted start")
        if os.path.lexists(journal):
            record = read_record(journal)
            check_record(record, scope_of(record["operation"]), journal)
            notes.append(_resolve(root, record, scope_of(record["operation"])))
        for path in list(_leftovers(scope)):
            _unlink(path)
            notes.append(f"deleted {shown(path)}, left by an interrupted write")
    except OSError as exc:  # deleting a leftover: no file of the tree changes
        raise PatchError(
            f"cannot delete what an interrupted write left ({what_failed(exc)})",
            path=exc.filename or str(journal),
            looked_for="a writable tree",
            found="the tree's files are as they were; the next vllm-patch command "
            "on this tree deletes it",
        ) from exc
    return notes


def _resolve(root: Path, record: dict, scope: Scope) -> str:
    """Finish or roll back the recorded operation; the note saying which."""
    try:
        ready = all(_is_ready(e) for e in record["renames"])
        renamed = _renamed(record)
    except ReadError as exc:
        why = f"could not be read back ({what_failed(exc)})"
        raise _stuck(root, record, why) from exc
    if ready:
        return _finish(root, record, scope)
    if not renamed:
        try:
            _roll_back(root, record)
        except (OSError, ReadError) as exc:
            raise _stuck(root, record, f"cannot roll back: {what_failed(exc)}") from exc
        return (
            f"rolled back an interrupted {record['operation']} before it changed "
            f"a file ({_files(record)} untouched)"
        )
    return _roll_back_or_stop(root, record, "was left half done", None)


def _finish(root: Path, record: dict, scope: Scope) -> str:
    """Make the remaining renames (rolled back when one fails), then clean up
    (kept for the next command when that fails: never rolled back)."""
    try:
        _rename_all(record)
    except OSError as exc:
        return _roll_back_or_stop(root, record, "could not be finished", exc)
    try:
        _clean_up(root, record, scope)
    except OSError as exc:
        raise _stuck(root, record, _unfinished(root, record, exc).message) from exc
    return f"finished an interrupted {record['operation']} ({_files(record)})"


def _roll_back_or_stop(root: Path, record: dict, why: str, exc: OSError | None) -> str:
    """Roll back a partly renamed operation, when every replaced file's
    ``.old`` is there to put back; else stop, the tree left as it is."""
    cause = f" ({what_failed(exc)})" if exc else ""
    try:
        possible = _can_roll_back(record)
    except ReadError as second:
        why = f"{why}{cause}; reading it back failed: {what_failed(second)}"
        raise _stuck(root, record, why) from second
    if not possible:
        raise _stuck(
            root,
            record,
            f"{why}{cause} and cannot be rolled back: a replaced file's .old "
            "name is gone",
        )
    try:
        _roll_back(root, record)
    except (OSError, ReadError) as second:
        raise _stuck(
            root, record, f"{why}{cause}; rolling it back failed: {what_failed(second)}"
        ) from second
    return (
        f"rolled back an interrupted {record['operation']} that {why}{cause} "
        f"({_files(record)} restored)"
    )


def _stuck(root: Path, record: dict, why: str) -> PatchError:
    return PatchError(
        f"an interrupted {record['operation']} {why}",
        path=str(root / JOURNAL),
        looked_for="an interrupted operation vllm-patch can finish or roll back",
        found=f"the tree is partly written ({_files(record)}); the record is kept "
        "and the next vllm-patch command on this tree tries again: fix the cause "
        "first (or, if it is not vllm-patch's, delete the record and reinstall vLLM)",
    )


def _leftovers(scope: Scope) -> Iterator[Path]:
    """The names vllm-patch gives the scope's files while writing, where they
    exist: ``.<name>.vllm-patch.new``/``.old``."""
    yield from (p for p in names(scope.files) if os.path.lexists(p))
