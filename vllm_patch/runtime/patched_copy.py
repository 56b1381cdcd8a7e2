"""vLLM as a patch leaves it, without touching the installed vLLM: a
hard-linked copy of the installed ``vllm/`` (``patcher.tree.linked_copy``)
patched by the engine, which writes by rename only, so no write goes through a
link. A child with the copy first on its ``PYTHONPATH`` imports the patched
vLLM (``vllm_patch.runtime.child``, ``pythonpath=``)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from patcher.backup import hex_digest
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
    folder to put first on ``PYTHONPATH``, removed on exit (the engine's
    ``PatchError`` propagates). ``record`` gets ``copy`` (the folder),
    ``apply`` (the engine's outcome) and ``changed`` (false on a tree that has
    the patch already); on exit, after the engine reverts the copy, ``revert``,
    ``hashes`` of the patch's files (before, applied, reverted), ``restored``
    (revert gave the bytes back) and ``original_unchanged`` (no write went
    through a link to the installed files)."""
    from patcher import engine  # libcst: only when a copy is made

    checked, record = record is not None, {} if record is None else record
    folder = Path(tempfile.mkdtemp(prefix="vllm-patch-copy-", dir=parent))
    try:
        copy = linked_copy(tree, folder)
        files = sorted({e.file for e in patch.edits})
        before = _hashes(copy, files)
        record["copy"] = str(folder)
        record["apply"] = str(engine.apply(copy, engine.plan(copy, patch)))
        applied = _hashes(copy, files)
        record["changed"] = applied != before
        try:
            yield folder
        finally:
            if checked:  # revert the copy only to see that revert works
                if applied != before:
                    record["revert"] = str(engine.revert(copy, patch))
                reverted = _hashes(copy, files)
                record["hashes"] = dict(
                    before=before, applied=applied, reverted=reverted
                )
                record["restored"] = reverted == before
                record["original_unchanged"] = _hashes(tree, files) == before
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _hashes(tree: VllmTree, files: list[str]) -> dict[str, str | None]:
    """Each file's SHA-256, None where it is missing."""
    found: dict[str, str | None] = {}
    for rel in files:
        try:
            found[rel] = hex_digest(tree.path(rel).read_bytes())
        except FileNotFoundError:
            found[rel] = None
    return found
