"""Reading a file named by the user or found in a tree: regular files only, of a
bounded size, and never blocking (a FIFO where a source file belongs must not
hang the command, a link to ``/dev/zero`` must not fill the memory)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
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


# --- Paths in a tree, and outputs, opened without a window between check and use.
# A path is resolved (links followed) and checked to lie inside its bases first;
# then every folder on the resolved path is opened with O_NOFOLLOW, one at a
# time, and the file relative to the last one: a link swapped in after the check
# makes the open fail instead of leading elsewhere. Writes create a new file
# beside the target exclusively (never through a name found there) and rename
# it over the target within that folder.


def inside(
    root: Path, rel: str | Path, bases: tuple[Path, ...] | None = None, *, what: str
) -> Path:
    """``root / rel`` with every link resolved, or ``PatchError`` (exit 3) when
    that leads out of ``bases`` (default: ``root``)."""
    path = Path(os.path.realpath(Path(root) / rel))
    bases = tuple(Path(os.path.realpath(b)) for b in (bases or (root,)))
    if any(path.is_relative_to(b) for b in bases):
        return path
    raise PatchError(
        f"{what} leads outside the tree (vllm-patch never follows a link out)",
        path=str(Path(root) / rel),
        looked_for=f"a path inside {' or '.join(map(str, bases))}",
        found=f"a link to {path}",
    )


def open_dir(folder: Path) -> int:
    """A file descriptor of the resolved ``folder``, each of its components
    opened with O_NOFOLLOW: ``PatchError`` if one of them is (now) a link."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    fd = os.open("/", flags)
    try:
        for name in folder.relative_to("/").parts:
            try:
                nxt = os.open(name, flags, dir_fd=fd)
            except OSError as exc:
                raise PatchError(
                    f"cannot open a folder on the way ({exc.strerror})",
                    path=str(folder),
                    looked_for=f"a real folder named {name!r}",
                    found="a link or something else (changed while read?)"
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR)
                    else exc.strerror,
                ) from exc
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_at(path: Path, what: str, *, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of the regular file at the resolved ``path``, opened through
    :func:`open_dir` (no link, FIFO or device; at most ``limit`` bytes)."""
    dfd = open_dir(path.parent)
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW, dir_fd=dfd)
    except FileNotFoundError as exc:
        raise PatchError(
            "file not found", path=str(path), looked_for=what, found="no such file"
        ) from exc
    except OSError as exc:
        found = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise _not_regular(str(path), what, found) from exc
    finally:
        os.close(dfd)
    try:
        return _read_fd(fd, str(path), what, limit)
    finally:
        os.close(fd)


def read_text_at(path: Path, what: str, *, limit: int = MAX_FILE_BYTES) -> str:
    """:func:`read_at` decoded as UTF-8 (no NUL byte); one ``PatchError`` else."""
    data = read_at(path, what, limit=limit)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PatchError(
            "not UTF-8 text",
            path=str(path),
            looked_for=what,
            found=f"byte {data[exc.start]:#04x} at offset {exc.start}",
        ) from exc
    if "\0" in text:
        raise PatchError(
            "not text", path=str(path), looked_for=what, found="a NUL byte"
        )
    return text


def replace_at(path: Path, data: bytes, *, mode: int | None = None) -> None:
    """Give the resolved ``path`` the content ``data``: a new file created
    exclusively beside it, fsynced, renamed over it in the same opened folder.
    An existing target must be a regular file (its mode is kept); a link, FIFO
    or folder there is refused, never written through."""
    dfd = open_dir(path.parent)
    try:
        try:
            st = os.stat(path.name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise _not_regular(str(path), "a regular file to replace", kind(st.st_mode))
        if mode is None:
            mode = stat.S_IMODE(st.st_mode) if st else 0o644
        tmp = f".{path.name}.{secrets.token_hex(6)}.vllm-patch.new"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        fd = os.open(tmp, flags, mode, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fchmod(fh.fileno(), mode)  # umask would narrow it
                os.fsync(fh.fileno())
            os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        os.fsync(dfd)
    finally:
        os.close(dfd)


def write_output(path: Path, data: bytes | str) -> Path:
    """Write a file the user named (``--out``, ``--format-patch``, a report in
    ``bench --out``): its folder is the user's choice, but a link, FIFO or other
    non-regular file found at the name itself is refused, never written through;
    a regular file there is replaced by rename."""
    path = Path(path)
    parent = Path(os.path.realpath(path.parent))
    if isinstance(data, str):
        data = data.encode("utf-8")
    replace_at(parent / path.name, data)
    return path


def output_dir(path: Path) -> Path:
    """A folder the user named for outputs: made if missing; refused when the
    name is a link or not a folder (whoever planted it chooses where it leads)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise PatchError(
            "not a folder",
            path=str(path),
            looked_for="a folder for outputs",
            found=kind(os.lstat(path).st_mode),
        ) from exc
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PatchError(
            "not a folder (vllm-patch never writes through a link it finds)",
            path=str(path),
            looked_for="a folder for outputs",
            found=kind(st.st_mode),
        )
    return path


# --- Data a command reads from a checkout (the CI YAML, the PR template, the
# ruff settings): no link anywhere below the checkout's root, or it is refused.


def read_text_in(
    root: Path | None, rel: str, what: str, *, limit: int = MAX_FILE_BYTES
) -> str | None:
    """``rel`` below the resolved ``root`` as :func:`read_text_at` reads it (so
    a link on the way is refused, not followed); None when there is no such
    file (or no ``root``)."""
    if root is None:
        return None
    path = Path(os.path.realpath(root)) / rel
    try:
        return read_text_at(path, what, limit=limit)
    except PatchError:
        if os.path.lexists(path):
            raise
        return None


def refusal(exc: PatchError) -> str:
    """A refusal on one line without its path: for text the user publishes."""
    parts = [exc.message, exc.looked_for and f"looked for {exc.looked_for}"]
    return "; ".join(p for p in [*parts, exc.found and f"found {exc.found}"] if p)
