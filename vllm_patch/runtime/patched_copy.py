"""vLLM as a patch leaves it, without touching the installed vLLM.

:func:`patched_copy` hard-links the installed ``vllm/`` package, its dist-info
and bundled libraries into a temporary folder (``patcher.tree.linked_copy``)
and applies a patch there with the engine. The engine writes by rename only,
so the links to the installed files are never written through. A child with
the folder first on its ``PYTHONPATH`` (``vllm_patch.runtime.child``: ``pythonpath=``)
imports the patched vLLM; the folder is removed afterwards.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from patcher.patchset import Patch
from patcher.tree import VllmTree, linked_copy


@contextlib.contextmanager
def patched_copy(
    tree: VllmTree,
    patch: Patch,
    *,
    parent: Path | None = None,
    record: dict[str, Any] | None = None,
) -> Iterator[Path]:
    """A temporary hard-linked copy of ``tree`` with ``patch`` applied: the
    folder to put first on ``PYTHONPATH``. Removed on exit.

    The engine's ``PatchError`` (it refuses to apply) propagates. With
    ``record``, what happened is written into it: ``copy`` (the folder),
    ``apply`` (the engine's outcome), ``changed`` (whether apply changed the
    patch's files: not on a tree that has the patch already); and on exit, after
    the copy is reverted with the engine (unless apply changed nothing),
    ``revert`` (its outcome), ``hashes`` of the patch's files (before, applied,
    reverted), ``restored`` (revert gave the pristine bytes back) and
    ``original_unchanged`` (the installed files are as they were: no write went
    through a link).
    """
    from patcher import engine  # libcst: only when a copy is made

    folder = Path(tempfile.mkdtemp(prefix="vllm-patch-copy-", dir=parent))
    try:
        copy = linked_copy(tree, folder)
        files = sorted({e.file for e in patch.edits})
        before = _hashes(copy, files)
        if record is not None:
            record["copy"] = str(folder)
        outcome = engine.apply(copy, patch)
        applied = _hashes(copy, files)
        if record is not None:
            record.update(apply=str(outcome), changed=applied != before)
        try:
            yield folder
        finally:
            if record is not None:
                if applied != before:
                    record["revert"] = str(engine.revert(copy, patch))
                reverted = _hashes(copy, files)
                record["hashes"] = {
                    "before": before,
                    "applied": applied,
                    "reverted": reverted,
                }
                record["restored"] = reverted == before
                record["original_unchanged"] = _hashes(tree, files) == before
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _hashes(tree: VllmTree, files: list[str]) -> dict[str, str | None]:
    return {f: sha256(tree.path(f)) for f in files}


def sha256(path: Path) -> str | None:
    """The file's SHA-256, None where it is missing."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except FileNotFoundError:
        return None
