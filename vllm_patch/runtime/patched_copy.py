"""A hard-linked copy of ``vllm/`` patched by the engine (which writes by rename
only: no write goes through a link), for a child's ``PYTHONPATH``."""

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from patcher.backup import hex_digest
from patcher.errors import UsageError
from patcher.patchset import Patch
from patcher.tree import VllmTree, linked_copy


def choose_patch(tree: VllmTree, name: str | None = None) -> Patch:
    """The patch ``name`` (else ``apply``'s pick); it must apply, since the
    installed vLLM is the base."""
    from patcher import engine
    from patcher.status import PlanStatus

    chosen = engine.choose(tree, [name] if name else None)
    found = [(p, engine.plan(tree, p).status) for p in chosen]
    for patch, status in found:
        if status is PlanStatus.APPLICABLE:
            return patch
    raise UsageError(
        "the installed vLLM is not unpatched, so there is no base to compare",
        path=str(tree.location),
        looked_for="an installed vLLM its default patch applies to",
        found="; ".join(f"{p.name}: {status}" for p, status in found),
    )


@contextlib.contextmanager
def patched_copy(
    tree: VllmTree,
    patch: Patch,
    *,
    parent: Path | None = None,
    record: dict[str, Any] | None = None,
) -> Iterator[Path]:
    """A temporary copy of ``tree`` with ``patch`` applied. ``record`` gets
    ``copy``, ``apply`` and ``changed``; on exit, the copy reverted: ``revert``,
    ``hashes`` of the patch's files (before, applied, reverted), ``restored``
    and ``original_unchanged`` (no write went through a link)."""
    from patcher import engine  # libcst: only when a copy is made

    files = sorted({e.file for e in patch.edits})

    def hashes(where: VllmTree) -> dict[str, str]:  # a file not there: no key
        found = {rel: where.path(rel) for rel in files}
        return {
            r: hex_digest(p.read_bytes()) for r, p in found.items() if p.is_file()
        }

    checked = record is not None  # the caller wants revert seen to work
    record = {} if record is None else record
    with tempfile.TemporaryDirectory(
        prefix="vllm-patch-copy-", dir=parent, ignore_cleanup_errors=True
    ) as folder:
        copy = linked_copy(tree, Path(folder))
        before = hashes(copy)
        record["copy"] = folder
        record["apply"] = str(engine.apply(copy, engine.plan(copy, patch)))
        applied = hashes(copy)
        record["changed"] = applied != before
        try:
            yield Path(folder)
        finally:
            if checked:  # revert the copy only to see that revert works
                if applied != before:
                    record["revert"] = str(engine.revert(copy, patch))
                record["hashes"] = dict(before=before, applied=applied)
                reverted = hashes(copy)
                record["hashes"]["reverted"] = reverted
                record["restored"] = reverted == before
                record["original_unchanged"] = hashes(tree) == before
