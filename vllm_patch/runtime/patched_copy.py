"""A hard-linked copy of ``vllm/`` patched by the engine (which writes by rename
only: no write goes through a link), for a child's ``PYTHONPATH``."""

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
    """The folder of a temporary copy of ``tree`` with ``patch`` applied,
    removed on exit. ``record`` gets ``copy``, ``apply`` (the engine's outcome)
    and ``changed``; on exit, the copy reverted: ``revert``, ``hashes`` of the
    patch's files (before, applied, reverted), ``restored`` and
    ``original_unchanged`` (no write went through a link)."""
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
    return {
        rel: hex_digest(tree.path(rel).read_bytes())
        if tree.path(rel).is_file()
        else None
        for rel in files
    }
