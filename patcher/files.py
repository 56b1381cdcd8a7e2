"""Reading a file named by the user or found in a tree: regular files only, of a
bounded size, and never blocking (a FIFO where a source file belongs must not
hang the command, a link to ``/dev/zero`` must not fill the memory)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from patcher.errors import PatchError, ReadError

MAX_FILE_BYTES = 2 << 20
"""The largest file read from a tree or a wheel (2 MiB). vLLM's largest source
file is about 0.3 MB (0.32.0); LibCST takes about 265 times a file's size to
parse it (measured: 1 GB for 4 MB), so this also keeps one hostile file from
making the codemods use more than about half a gigabyte."""
MAX_RECORD_BYTES = 1 << 20
"""The largest intent record or backup manifest read (1 MiB): vllm-patch writes
them at a few kilobytes."""

_KINDS = [
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISLNK, "a symbolic link"),
]


def kind(mode: int) -> str:
    """What a file is, in words, from its ``st_mode``."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def read_regular(
    path: Path,
    shown: str | None = None,
    looked_for: str = "a regular file",
    *,
    limit: int = MAX_FILE_BYTES,
    follow: bool = True,
) -> bytes:
    """The bytes of the regular file at ``path`` (a symlink is followed unless
    ``follow`` is false), at most ``limit`` of them; ``PatchError`` naming
    ``shown`` (default: the path) for anything else."""
    shown = shown or str(path)
    # O_NONBLOCK: opening a FIFO for reading would wait for a writer.
    flags = os.O_RDONLY | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as exc:
        raise PatchError(
            "file not found", path=shown, looked_for=looked_for, found="no such file"
        ) from exc
    except OSError as exc:
        if not follow and os.path.islink(path):
            raise _not_regular(shown, looked_for, "a symbolic link") from exc
        raise ReadError(f"cannot read (open: {exc.strerror})", path=shown) from exc
    try:
        return _read_fd(fd, shown, looked_for, limit)
    except OSError as exc:
        raise ReadError(f"cannot read (read: {exc.strerror})", path=shown) from exc
    finally:
        os.close(fd)


def _read_fd(fd: int, shown: str, looked_for: str, limit: int) -> bytes:
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        raise _not_regular(shown, looked_for, kind(mode))
    with os.fdopen(os.dup(fd), "rb") as fh:
        data = fh.read(limit + 1)  # a file growing while read is caught too
    if len(data) > limit:
        raise too_big(shown, looked_for, limit)
    return data


def _not_regular(shown: str, looked_for: str, found: str) -> PatchError:
    return PatchError(
        "not a regular file", path=shown, looked_for=looked_for, found=found
    )


def too_big(shown: str, looked_for: str, limit: int) -> PatchError:
    return PatchError(
        "file too large",
        path=shown,
        looked_for=f"{looked_for}, at most {limit} bytes",
        found="more",
    )


def read_json(path: Path, looked_for: str) -> object:
    """The JSON document in the regular file at ``path`` (never through a link,
    at most ``MAX_RECORD_BYTES``); ``PatchError`` for anything else, a document
    nested too deep for the parser included."""
    data = read_regular(
        path, looked_for=looked_for, limit=MAX_RECORD_BYTES, follow=False
    )
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        found = "JSON nested too deep" if isinstance(exc, RecursionError) else exc
        raise PatchError(
            "not a readable JSON document",
            path=str(path),
            looked_for=looked_for,
            found=str(found),
        ) from exc
