"""All-or-nothing writes across several files.

Every new content goes to a temporary file beside its target first; only when
all of them are written and synced are they renamed into place. If a rename
fails part way, the files already replaced get their old bytes back.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from patcher.errors import PatchError

WRITE_BITS = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH


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


def _write_temp(path: Path, data: bytes, mode: int | None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, stat.S_IMODE(mode))
    except BaseException:
        os.unlink(tmp)
        raise
    return Path(tmp)


def write_atomically(files: dict[Path, bytes]) -> None:
    """Replace (or create) every file in ``files``, or none of them."""
    for path in files:
        check_writable(path)
    originals = {p: p.read_bytes() if p.is_file() else None for p in files}
    modes = {p: p.stat().st_mode if p.is_file() else None for p in files}
    temps: dict[Path, Path] = {}
    try:
        for path, data in files.items():
            temps[path] = _write_temp(path, data, modes[path])
    except OSError as exc:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
        raise PatchError(
            f"cannot write: {exc.strerror}", path=str(exc.filename or path)
        ) from exc

    replaced: list[Path] = []
    try:
        for path, tmp in temps.items():
            os.replace(tmp, path)
            replaced.append(path)
    except OSError as exc:
        _roll_back(replaced, originals, modes)
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
        raise PatchError(
            f"cannot replace: {exc.strerror}; every file was restored",
            path=str(exc.filename or path),
        ) from exc


def _roll_back(
    replaced: list[Path], originals: dict[Path, bytes | None], modes: dict
) -> None:
    for path in replaced:
        old = originals[path]
        if old is None:
            path.unlink(missing_ok=True)
        else:
            os.replace(_write_temp(path, old, modes[path]), path)
