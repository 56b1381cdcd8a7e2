"""Reading a file named by the user or found in a tree: regular files only, and
never blocking (a FIFO where a source file belongs must not hang the command)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from patcher.errors import PatchError

_KINDS = [
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
]


def kind(mode: int) -> str:
    """What a file is, in words, from its ``st_mode``."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def read_regular(
    path: Path, shown: str | None = None, looked_for: str = "a regular file"
) -> bytes:
    """The bytes of the regular file at ``path`` (a symlink is followed);
    ``PatchError`` naming ``shown`` (default: the path) for anything else."""
    shown = shown or str(path)
    try:
        # O_NONBLOCK: opening a FIFO for reading would wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError as exc:
        raise PatchError(
            "file not found", path=shown, looked_for=looked_for, found="no such file"
        ) from exc
    except OSError as exc:
        raise PatchError(f"cannot read: {exc.strerror}", path=shown) from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise PatchError(
                "not a regular file",
                path=shown,
                looked_for=looked_for,
                found=kind(mode),
            )
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise PatchError(f"cannot read: {exc.strerror}", path=shown) from exc
    finally:
        os.close(fd)
