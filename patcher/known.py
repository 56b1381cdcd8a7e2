"""Trees a patch's codemods have already judged: ``check`` without LibCST.

``nox -s render`` plans each patch on the real wheels it is rendered against
and records, beside the rendered diffs (``rendered/known.json``), the SHA-256
of every file each plan read before the patch and after it. A tree whose files
are byte for byte one of those is known to be ``applicable`` (the "before"
files) or ``applied`` (the "after" files), so ``check`` answers it without
importing LibCST or running a codemod. The record holds a fingerprint of the
code that judged (the patch's folder, the engine, the LibCST and ruff
versions): when that code changes, the record is ignored until rendered again,
and every tree is planned in full, as is any tree the record does not hold.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path

from patcher.atomic import sha256
from patcher.errors import PatchError
from patcher.files import MAX_RECORD_BYTES, read_regular
from patcher.tree import VllmTree

FILE_NAME = "known.json"
ENGINE = Path(__file__).resolve().parent
JUDGING_DISTRIBUTIONS = ("libcst", "ruff")


def fingerprint(patch_folder: Path) -> str:
    """SHA-256 of the code that judges a tree: the patch's own files, the
    engine's modules, and the LibCST and ruff releases."""
    digest = hashlib.sha256()
    files = [*sorted(patch_folder.glob("*.py")), patch_folder / "patch.toml"]
    for path in [*files, *sorted(ENGINE.glob("*.py"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for name in JUDGING_DISTRIBUTIONS:
        digest.update(f"{name}=={metadata.version(name)}\0".encode())
    return digest.hexdigest()


def _digest(text: str) -> str:
    return sha256(text.encode("utf-8"))


def entry(
    label: str, sources: Mapping[str, str], changes: Mapping[str, tuple[str, str]]
) -> dict:
    """One judged tree, from a plan's ``sources`` and ``file_changes()``."""
    before = {rel: _digest(text) for rel, text in sorted(sources.items())}
    after = {**before, **{rel: _digest(new) for rel, (_, new) in changes.items()}}
    return {"tree": label, "before": before, "after": after}


def document(patch_folder: Path, entries: Iterable[dict]) -> str:
    """The record's text, as ``render`` writes it."""
    doc = {"fingerprint": fingerprint(patch_folder), "trees": list(entries)}
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def judged(tree: VllmTree, patch_folder: Path, edited: Iterable[str]) -> str | None:
    """``"applicable"`` or ``"applied"`` when ``tree`` holds, byte for byte,
    every file a judged tree's plan read (the ``edited`` files among them),
    before or after the patch; None when the record does not know the tree
    or is stale."""
    hashes: dict[str, str | None] = {}

    def found(rel: str) -> str | None:
        if rel not in hashes:
            try:
                hashes[rel] = _digest(tree.read_text(rel))
            except PatchError:  # missing or unreadable: the full plan says why
                hashes[rel] = None
        return hashes[rel]

    for known in _record(patch_folder):
        before, after = known.get("before"), known.get("after")
        if not (isinstance(before, dict) and isinstance(after, dict)):
            continue
        if not set(edited) <= before.keys():
            continue
        state = {rel: found(rel) for rel in before}
        if state == before:
            return "applicable"
        if state == after:
            return "applied"
    return None


def _record(patch_folder: Path) -> list[dict]:
    """The judged trees, when the record is there, well-formed and current."""
    path = patch_folder / "rendered" / FILE_NAME
    try:
        doc = json.loads(read_regular(path, limit=MAX_RECORD_BYTES))
    except (PatchError, ValueError, RecursionError):
        return []
    if not isinstance(doc, dict) or doc.get("fingerprint") != fingerprint(patch_folder):
        return []
    trees = doc.get("trees")
    return [t for t in trees if isinstance(t, dict)] if isinstance(trees, list) else []
