"""All-or-nothing writes across several files, whole even after a SIGKILL.

The rule that keeps hard-linked copies safe: **every write is a rename of a new
file, never an in-place write.** No existing file is opened for writing: new bytes
go to a new file beside the target, which is then renamed over it; a rename changes
what a name points to and never writes through another name of the same inode.
``tree.linked_copy`` shares inodes with the install it copies and relies on this;
so does the ``.old`` name below.

The protocol, the way git and package managers make a multi-file write survive a
kill at any instruction:

1. Everything happens under an exclusive ``flock`` on the tree root (the kernel
   drops it when its holder dies), so one writer at a time.
2. An intent record, ``<root>/.vllm-patch-journal.json``, is written, fsynced and
   renamed into place before anything else. It names every rename to make (the new
   file, its target, the SHA-256 of the new bytes, the ``.old`` name that keeps the
   replaced file), the folders it creates and the folders to delete once the
   renames are done (a discarded backup).
3. Each new content is written to ``.<name>.vllm-patch.new`` beside its target and
   fsynced; each replaced file gets a second name, ``.<name>.vllm-patch.old``.
4. The ``.new`` files are renamed over their targets, the folders deleted, then the
   ``.old`` names and the record removed.

``recover`` runs before every command: with a record present, the operation is
finished when every new file is complete (still waiting under its ``.new`` name,
or already renamed, by its hash), and rolled back otherwise (then nothing was
renamed yet: the ``.new``/``.old`` names and created folders are deleted). A rename
that fails in-process (an immutable file) rolls back by renaming ``.old`` back.
Without a record, files with these names (and the ``.<name>.XXXXXXXX.tmp`` files of
earlier versions, which wrote without a record) are leftovers and deleted.

Tests inject a SIGKILL (or an ``OSError``) at any step through ``FAULT_ENV``.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import signal
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from patcher.errors import PatchError
from patcher.files import kind

JOURNAL = ".vllm-patch-journal.json"
NEW, OLD = ".vllm-patch.new", ".vllm-patch.old"
_LEFTOVER = re.compile(r"^\..+\.vllm-patch\.(new|old)$")
_LEGACY_TEMP = re.compile(r"^\.(?P<name>.+)\.[a-z0-9_]{8}\.tmp$")

WRITE_BITS = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH

FAULT_ENV = "VLLMPATCH_FAULT"
"""For tests only: ``N`` or ``KIND:N`` (KIND one of fsync, rename, link, unlink,
mkdir, rmdir, write) SIGKILLs this process just before its N-th such step;
``KIND:N:EIO`` raises that ``OSError`` there instead."""
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
        raise OSError(code, os.strerror(code), f"<{kind} fault injected>")
    os.kill(os.getpid(), signal.SIGKILL)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# The only calls that change the file system, each a fault point.
def _fsync_dir(path: Path) -> None:
    _step("fsync")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """A fresh file (never through an existing name or link), synced."""
    _unlink(path)
    _step("write")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fchmod(fd, mode)
        _step("fsync")
        os.fsync(fd)
    finally:
        os.close(fd)


def _rename(src: Path, dst: Path) -> None:
    _step("rename")
    os.replace(src, dst)


def _link(src: Path, dst: Path) -> None:
    _step("link")
    os.link(src, dst, follow_symlinks=False)


def _unlink(path: Path) -> None:
    if os.path.lexists(path):
        _step("unlink")
        os.unlink(path)


def _mkdir(path: Path) -> None:
    _step("mkdir")
    os.mkdir(path)


def _rmdir_if_empty(path: Path) -> None:
    if path.is_dir() and not any(path.iterdir()):
        _step("rmdir")
        os.rmdir(path)


def _rmtree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        for child in sorted(path.iterdir(), reverse=True):
            _rmtree(child)
        _step("rmdir")
        os.rmdir(path)
    else:
        _unlink(path)


# Checks made before anything is written.
def check_writable(path: Path) -> None:
    """Refuse files and folders marked read-only, even when running as root
    (who could write them anyway: a read-only mark is a request to leave it)."""
    target = path if path.exists() else path.parent
    while not target.exists():
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
    if path.exists() and not path.is_file():
        raise PatchError(
            "not a regular file",
            path=str(path),
            looked_for="a regular file to replace",
            found=kind(path.stat().st_mode),
        )


def target_of(path: Path) -> Path:
    """Where a write to ``path`` lands: a symlink's target (the link is kept)."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


@contextmanager
def locked(root: Path) -> Iterator[None]:
    """One writer at a time on a tree (not re-entrant)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


# The intent record.
def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(f".{path.name}{suffix}")


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
    *,
    remove: Iterable[Path] = (),
    label: str = "write",
) -> None:
    """Replace (or create) every file in ``files``, then delete the folders in
    ``remove``; all of it or, on an error, none. ``root`` holds the intent record;
    the caller holds ``locked(root)``."""
    targets = {target_of(p): data for p, data in files.items()}
    for path in [root, *targets]:
        check_writable(path)
    for path in targets:
        _refuse_non_regular(path)
    created = _missing_parents(root, targets)
    renames = [
        {
            "target": str(path),
            "new": str(_sibling(path, NEW)),
            "old": str(_sibling(path, OLD)) if path.exists() else None,
            "sha256": sha256(data),
        }
        for path, data in targets.items()
    ]
    record = {
        "operation": label,
        "renames": renames,
        "created_folders": [str(p) for p in created],
        "remove": [str(p) for p in remove],
    }
    try:
        _write_record(root, record)
        for folder in created:
            _mkdir(folder)
        for entry, data in zip(renames, targets.values(), strict=True):
            target = Path(entry["target"])
            mode = stat.S_IMODE(target.stat().st_mode) if entry["old"] else 0o600
            _write_new(Path(entry["new"]), data, mode)
            if entry["old"]:
                _keep_old(target, Path(entry["old"]))
    except OSError as exc:
        _roll_back(root, record)
        raise PatchError(
            f"cannot write: {exc.strerror}; nothing was changed",
            path=str(exc.filename or root),
        ) from exc
    try:
        for entry in renames:
            _rename(Path(entry["new"]), Path(entry["target"]))
    except OSError as exc:
        _roll_back(root, record)
        raise PatchError(
            f"cannot replace: {exc.strerror}; every file was restored",
            path=str(exc.filename or entry["target"]),
        ) from exc
    _finish(root, record)


def _missing_parents(root: Path, targets: Iterable[Path]) -> list[Path]:
    created: list[Path] = []
    for path in targets:
        missing = []
        parent = path.parent
        while not parent.exists():
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
        _write_new(old, target.read_bytes(), stat.S_IMODE(target.stat().st_mode))


def _is_renamed(entry: dict) -> bool:
    target = Path(entry["target"])
    return (
        not os.path.lexists(entry["new"])
        and target.is_file()
        and sha256(target.read_bytes()) == entry["sha256"]
    )


def _is_ready(entry: dict) -> bool:
    new = Path(entry["new"])
    if not new.is_file():
        return _is_renamed(entry)
    return sha256(new.read_bytes()) == entry["sha256"]


def _finish(root: Path, record: dict) -> None:
    for entry in record["renames"]:
        if os.path.lexists(entry["new"]):
            _rename(Path(entry["new"]), Path(entry["target"]))
    for folder in sorted({Path(e["target"]).parent for e in record["renames"]}):
        _fsync_dir(folder)
    for folder in record["remove"]:
        folder = Path(folder)
        _rmtree(folder)
        _rmdir_if_empty(folder.parent)
    for entry in record["renames"]:
        if entry["old"]:
            _unlink(Path(entry["old"]))
    _drop_record(root)


def _roll_back(root: Path, record: dict) -> None:
    for entry in reversed(record["renames"]):
        target, new = Path(entry["target"]), Path(entry["new"])
        old = Path(entry["old"]) if entry["old"] else None
        if _is_renamed(entry):
            if old is not None and os.path.lexists(old):
                _rename(old, target)
            elif old is None:
                _unlink(target)
        _unlink(new)
        if old is not None:
            _unlink(old)
    for folder in reversed(record["created_folders"]):
        _rmdir_if_empty(Path(folder))
    _drop_record(root)


# Recovery.
def pending(root: Path, folders: Iterable[Path] = ()) -> bool:
    """Is there an interrupted operation (or a leftover) to deal with?"""
    if os.path.lexists(root / JOURNAL) or os.path.lexists(_record_new(root)):
        return True
    return any(_leftovers(folders))


def recover(root: Path, folders: Iterable[Path] = ()) -> list[str]:
    """Finish or roll back an interrupted operation on ``root``, then delete
    leftovers in ``folders``; what was done, one line each. The caller holds
    ``locked(root)``."""
    notes: list[str] = []
    journal = root / JOURNAL
    try:
        if os.path.lexists(_record_new(root)):  # a record never completed
            _unlink(_record_new(root))
            notes.append(f"deleted {_record_new(root)}, an interrupted start")
        if os.path.lexists(journal):
            record = _read_record(journal)
            ready = all(_is_ready(e) for e in record["renames"])
            files = ", ".join(e["target"] for e in record["renames"]) or "no file"
            try:
                if ready:
                    _finish(root, record)
                    notes.append(
                        f"finished an interrupted {record['operation']} ({files})"
                    )
                else:
                    _roll_back(root, record)
                    notes.append(
                        f"rolled back an interrupted {record['operation']} before "
                        f"it changed a file ({files} untouched)"
                    )
            except OSError:
                _roll_back(root, record)
                notes.append(
                    f"rolled back an interrupted {record['operation']} that could "
                    f"not be finished ({files} restored)"
                )
        for path in list(_leftovers(folders)):
            _unlink(path)
            notes.append(f"deleted {path}, left by an interrupted write")
    except OSError as exc:
        raise PatchError(
            f"cannot finish or roll back an interrupted operation: {exc.strerror}",
            path=str(exc.filename or journal),
            looked_for=f"a writable tree to complete {journal}",
            found="it is left as it is; run again once the file can be written",
        ) from exc
    return notes


_ENTRY = {"target": str, "new": str, "old": (str, type(None)), "sha256": str}


def _read_record(journal: Path) -> dict:
    try:
        record = json.loads(journal.read_text("utf-8"))
    except (OSError, ValueError):
        record = None
    if not _valid_record(record):
        raise PatchError(
            "unreadable record of an interrupted operation",
            path=str(journal),
            looked_for="the JSON record vllm-patch writes before it renames files",
            found="something else; the files it names are left as they are: "
            "check them, then delete it",
        )
    return record


def _valid_record(record: object) -> bool:
    if not isinstance(record, dict) or not isinstance(record.get("operation"), str):
        return False
    lists = [record.get(k) for k in ("renames", "created_folders", "remove")]
    if not all(isinstance(v, list) for v in lists):
        return False
    return all(
        isinstance(e, dict) and all(isinstance(e.get(k), t) for k, t in _ENTRY.items())
        for e in record["renames"]
    ) and all(isinstance(p, str) for p in lists[1] + lists[2])


def _leftovers(folders: Iterable[Path]) -> Iterator[Path]:
    for folder in folders:
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            legacy = _LEGACY_TEMP.match(path.name)
            if _LEFTOVER.match(path.name) or (
                legacy and (folder / legacy["name"]).exists()
            ):
                yield path
