"""Every file vllm-patch reads or writes in a tree, or that the user names: the
path resolved and checked inside its bases, then each folder opened O_NOFOLLOW
from ``/`` (a link swapped in after the check fails the open); reads bounded,
regular files only; writes by renaming a new fsynced file over the target."""

import contextlib
import errno
import fcntl
import os
import secrets
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

from patcher.errors import PatchError, UsageError, printable

# The largest file read from a tree or a wheel: vLLM's largest source is about
# 0.3 MB, and LibCST takes about 265 times a file's size to parse it.
MAX_FILE_BYTES = 2 << 20
NEW = ".vllm-patch.new"  # the suffix of the file replace_at renames
# What a file is, in words, by the first letter ``stat.filemode`` gives it.
_KINDS = {
    "d": "a directory",
    "p": "a FIFO (named pipe)",
    "s": "a socket",
    "c": "a character device",
    "b": "a block device",
    "l": "a symbolic link",
    "-": "a regular file",
}
# What is there when an open fails with an errno (0: nothing; ENXIO: a socket).
_FOUND = {
    errno.ENOENT: 0,
    errno.ELOOP: stat.S_IFLNK,
    errno.EISDIR: stat.S_IFDIR,
    errno.ENXIO: stat.S_IFSOCK,
}
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def kind(mode: int) -> str:
    """What a file is, in words, from its ``st_mode``."""
    return _KINDS.get(stat.filemode(mode)[0], "not a regular file")


def inside(root: Path, rel: str | Path, bases=None, *, what: str) -> Path:
    """``root / rel``, links resolved; ``PatchError`` if that leaves ``bases``."""
    path = Path(os.path.realpath(Path(root) / rel))
    bases = [Path(os.path.realpath(b)) for b in (bases or (root,))]
    if any(path.is_relative_to(b) for b in bases):
        return path
    message = f"{what} leads outside the tree (vllm-patch never follows a link out)"
    within = f"a path inside {' or '.join(map(str, bases))}"
    raise PatchError(message, str(Path(root) / rel), within, f"a link to {path}")


@contextlib.contextmanager
def open_dir(folder: Path, make_below: Path | None = None) -> Iterator[int]:
    """A descriptor of the resolved ``folder``, each component opened O_NOFOLLOW
    (a link: ``PatchError``); missing folders below ``make_below`` are made."""
    fd = os.open("/", _DIR)
    try:
        for i, name in enumerate(folder.parts[1:], 2):
            here = Path(*folder.parts[:i])
            if make_below and here.is_relative_to(make_below):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=fd)
            try:
                below = os.open(name, _DIR, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                found = "a symbolic link or a file (changed while read?)"
                raise PatchError(
                    "not a folder", str(here), "a folder", found
                ) from exc
            os.close(fd)
            fd = below
        yield fd
    finally:
        os.close(fd)


def read_at(path: Path, what: str, *, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of the regular file at the resolved ``path``, at most ``limit``."""

    def opener(name: str, flags: int) -> int:
        return os.open(name, flags | os.O_NONBLOCK | os.O_NOFOLLOW, dir_fd=dfd)

    try:
        with open_dir(path.parent) as dfd:
            file = open(path.name, "rb", opener=opener)
        with file:
            mode = os.fstat(file.fileno()).st_mode
            data = file.read(limit + 1) if stat.S_ISREG(mode) else None
    except OSError as exc:
        if exc.errno not in _FOUND:
            raise PatchError(f"cannot read ({exc.strerror})", str(path)) from exc
        mode = _FOUND[exc.errno]
        data = None
    if data is None:
        raise _not_regular(path, what, mode)
    return bounded(data, str(path), what, limit)


def _not_regular(path: Path, what: str, mode: int) -> PatchError:
    """What is at ``path`` is not a regular file (``mode`` 0: there is nothing)."""
    if not mode:
        return PatchError("file not found", str(path), what, "no such file")
    return PatchError("not a regular file", str(path), what, kind(mode))


def bounded(
    data: bytes, shown: str, what: str, limit: int = MAX_FILE_BYTES
) -> bytes:
    """``data``, unless it is more than ``limit`` bytes: then ``PatchError``."""
    if len(data) > limit:
        wanted = f"{what}, at most {limit} bytes"
        raise PatchError("file too large", shown, wanted, "more")
    return data


def read_text_at(path: Path, what: str, *, limit: int = MAX_FILE_BYTES) -> str:
    """:func:`read_at` decoded as UTF-8 (no NUL byte); one ``PatchError`` else."""
    return decode(read_at(path, what, limit=limit), str(path), what)


def decode(data: bytes, where: str, what: str, *, nul: bool = False) -> str:
    """``data`` as UTF-8; a NUL byte refused unless ``nul`` (the parser says
    where)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        found = f"byte {data[exc.start]:#04x} at offset {exc.start}"
        raise PatchError("not UTF-8", where, what, found) from exc
    if "\0" in text and not nul:
        raise PatchError("not text", where, what, "a NUL byte")
    return text


def replace_at(path: Path, data: bytes, *, make_below: Path | None = None) -> None:
    """Give the resolved ``path`` ``data`` by rename;
    a regular file's mode is kept."""
    with open_dir(path.parent, make_below) as dfd:
        try:
            mode = os.stat(path.name, dir_fd=dfd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            mode = stat.S_IFREG | 0o644
        if not stat.S_ISREG(mode):
            raise _not_regular(path, "a regular file to replace", mode)
        tmp = f".{path.name}.{secrets.token_hex(6)}{NEW}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        fd = os.open(tmp, flags, stat.S_IMODE(mode), dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fchmod(fd, stat.S_IMODE(mode))  # umask would narrow it
                os.fsync(fd)
            os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        os.fsync(dfd)


def remove_at(path: Path, *, leftovers: bool = False) -> None:
    """Delete what is at the resolved ``path`` (a folder with its contents, a
    link not its target), or with ``leftovers`` what a killed replace_at left."""
    with (
        contextlib.suppress(FileNotFoundError, PatchError),
        open_dir(path.parent) as dfd,
    ):
        for name in os.listdir(dfd) if leftovers else [path.name]:
            left = name.startswith(f".{path.name}.") and name.endswith(NEW)
            if left or not leftovers:
                _remove(name, dfd)


def _remove(name: str, dfd: int) -> None:
    try:
        os.unlink(name, dir_fd=dfd)
    except IsADirectoryError:
        sub = os.open(name, _DIR, dir_fd=dfd)
        try:
            for child in os.listdir(sub):
                _remove(child, sub)
        finally:
            os.close(sub)
        os.rmdir(name, dir_fd=dfd)


_waited: set[Path] = set()
_writing: set[str] = set()  # the trees this process holds the writer's lock on


@contextlib.contextmanager
def locked(root: Path, *, shared: bool = False) -> Iterator[None]:
    """One writer at a time on a tree, or readers beside each other: a ``flock``
    on its root folder; inside the writer's lock the process takes it again."""
    real = os.path.realpath(root)
    if real in _writing:
        yield
        return
    how = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    with open_dir(Path(real)) as fd:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
        except BlockingIOError:
            if root not in _waited:
                _waited.add(root)
                waiting = f"waiting for another vllm-patch on {printable(root)}"
                print(f"vllm-patch: {waiting}", file=sys.stderr, flush=True)
            fcntl.flock(fd, how)
        _writing.update([] if shared else [real])
        try:
            yield
        finally:
            _writing.discard(real)


def write_output(path: Path, data: bytes | str) -> Path:
    """Write a file the user named (``--out``), never through what is at the
    name."""
    real = Path(os.path.realpath(Path(path).parent)) / Path(path).name
    replace_at(real, data.encode() if isinstance(data, str) else data)
    return Path(path)


def output_dir(path: Path) -> Path:
    """A folder the user named for outputs, made if missing;
    a link there refused."""
    with contextlib.suppress(FileExistsError, NotADirectoryError):
        Path(path).mkdir(parents=True, exist_ok=True)
    mode = os.lstat(path).st_mode
    if not stat.S_ISDIR(mode):
        message = "not a folder (vllm-patch never writes through a link it finds)"
        raise PatchError(message, str(path), "a folder for outputs", kind(mode))
    return Path(path)


def output_path(
    root: Path, path: Path, what: str, *, folder=False, but=None
) -> Path:
    """``path`` for an output of a command on the work tree ``root``: outside it
    (``but`` excepted), no link or special file planted at the name."""
    real = path.parent.resolve() / path.name
    in_work_tree = real.is_relative_to(root.resolve())
    excepted = but and real.is_relative_to(but)
    if in_work_tree and not excepted:
        raise UsageError(f"{what} must be outside the work tree", str(path))
    mode = os.lstat(path).st_mode if os.path.lexists(path) else None
    if mode is not None and not (stat.S_ISDIR if folder else stat.S_ISREG)(mode):
        message = "vllm-patch never writes through a link or special file it finds"
        wanted = "a folder" if folder else "a regular file or no file"
        raise UsageError(message, str(path), wanted, kind(mode))
    return path


def own_paths(root: Path, files: list[str]) -> None:
    """Each of ``files`` at its own path below ``root`` (git would commit a
    link)."""
    real = Path(os.path.realpath(root))
    for rel in files:
        found = Path(os.path.realpath(root / rel))
        if found != real / rel:
            why = (
                "a file the change edits is reached through a link in the checkout"
            )
            wanted = "a regular file (or none) at that path, no link on the way"
            to = found.relative_to(real) if found.is_relative_to(real) else None
            link = f"a link to {to}" if to else "a link out of the checkout"
            raise UsageError(why, str(root / rel), wanted, link)


def read_text_in(
    root: Path | None, rel: str, what: str, *, limit: int = MAX_FILE_BYTES
) -> str | None:
    """``rel`` in a checkout as :func:`read_text_at` reads it;
    None if it is absent."""
    path = Path(os.path.realpath(root or ".")) / rel
    try:
        return read_text_at(path, what, limit=limit) if root else None
    except PatchError:
        if os.path.lexists(path):
            raise
        return None


def refusal(exc: PatchError) -> str:
    """A refusal on one line without its path: for text the user publishes."""
    parts = [exc.message, exc.looked_for and f"looked for {exc.looked_for}"]
    return "; ".join(p for p in [*parts, exc.found and f"found {exc.found}"] if p)
