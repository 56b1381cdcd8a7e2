"""Where vllm-patch may act: inside the tree it was pointed at (and, for a git
checkout, its git directory). Every path it reads, writes, renames or deletes
is derived by the tool from the tree and the patch, then checked here with
every symbolic link resolved."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from patcher.errors import PatchError


def real(path: Path) -> Path:
    """``path`` with every symbolic link resolved (it need not exist)."""
    return Path(os.path.realpath(path))


def is_inside(path: Path, bases: Iterable[Path]) -> bool:
    """Does ``path``, links resolved, lie in one of ``bases`` (or is one)?"""
    resolved = real(path)
    return any(resolved.is_relative_to(real(base)) for base in bases)


def refuse_outside(path: Path, bases: Iterable[Path], shown: str, what: str) -> Path:
    """``path`` resolved, or a ``PatchError`` naming the link and where it leads."""
    bases = list(bases)
    if is_inside(path, bases):
        return real(path)
    raise PatchError(
        f"{what} leads outside the tree (vllm-patch never follows a link out)",
        path=shown,
        looked_for=f"a path inside {' or '.join(map(str, bases))}",
        found=f"a link to {real(path)}",
    )


def refuse_links(path: Path, base: Path, what: str) -> None:
    """Refuse ``path`` when it, or a folder between ``base`` and it, is a
    symbolic link (``base`` itself resolved already)."""
    here = base
    for name in path.relative_to(base).parts:
        here = here / name
        if os.path.islink(here):
            raise PatchError(
                f"{what} is a symbolic link (vllm-patch never follows one there)",
                path=str(here),
                looked_for="a real folder or file",
                found=f"a link to {os.readlink(here)}",
            )
