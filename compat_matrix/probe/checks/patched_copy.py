"""A hard-linked copy of the installed vLLM with the patch applied, for the
checks that need vLLM as the patch leaves it; the installed files never change.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from compat_matrix.probe.framework import Fail


@contextmanager
def patched_copy(original, tmp: Path, engine, patch, details: dict) -> Iterator[Path]:
    """A hard-linked copy of ``original`` with ``patch`` applied; reverted (and
    checked byte-identical against the copy before the patch) on exit."""
    from patcher.tree import linked_copy

    tree = linked_copy(original, tmp / "tree")
    copy = tree.location
    details["copy"] = str(copy)
    files = sorted({e.file for e in patch.edits})
    before = {f: sha256(tree.path(f)) for f in files}
    try:
        outcome = engine.apply(tree, patch)
    except Exception as exc:  # PatchError: names the file, what it looked for and found
        raise Fail(f"the patch engine refused to apply: {exc}", details) from None
    applied = {f: sha256(tree.path(f)) for f in files}
    details["apply"] = str(outcome)
    if applied == before:
        raise Fail(f"apply changed nothing on a pristine copy: {outcome}", details)
    try:
        yield copy
    finally:
        details["revert"] = str(engine.revert(tree, patch))
        after = {f: sha256(tree.path(f)) for f in files}
        details["hashes"] = {"before": before, "applied": applied, "reverted": after}
        details["restored"] = after == before


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
