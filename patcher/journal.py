"""The intent record of an all-or-nothing write, ``<tree>/.vllm-patch-journal.json``,
and what one may name.

A record found on disk was left by a command that died, or planted by whoever
prepared the tree: it is data to check, never a list of orders. Every path it
names must be one the tool derives itself from the tree and the patch the
record is about (a :class:`Scope`), or the command refuses (exit 3) and
changes nothing. The same check runs on every record before it is written.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from patcher.confine import is_inside
from patcher.errors import PatchError
from patcher.files import read_json

JOURNAL = ".vllm-patch-journal.json"
NEW, OLD = ".vllm-patch.new", ".vllm-patch.old"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_LABEL = re.compile(r"^(apply|revert) of (?P<patch>[A-Za-z0-9_.-]+)$")
_ENTRY = {"target": str, "new": str, "old": (str, type(None)), "sha256": str}


def sibling(path: Path, suffix: str) -> Path:
    """The ``.<name><suffix>`` name beside ``path``: where its new bytes wait
    (``NEW``), or the second name of the file it replaces (``OLD``)."""
    return path.with_name(f".{path.name}{suffix}")


@dataclass(frozen=True)
class Scope:
    """What one operation may touch, derived from the tree and the patch: never
    read from a record. Every path is resolved (no link in it)."""

    bases: tuple[Path, ...]
    """The tree root, and a checkout's git directory (the backups' home)."""
    files: frozenset[Path] = frozenset()
    """The files it may replace, create or delete (sources and backup copies)."""
    trees: frozenset[Path] = frozenset()
    """The folders it may empty of ``files`` and delete (a discarded backup)."""

    def folders(self) -> frozenset[Path]:
        """The folders it may create: those between a base and one of ``files``."""
        out = set()
        for path in self.files:
            for parent in path.parents:
                if parent in self.bases or not is_inside(parent, self.bases):
                    break
                out.add(parent)
        return frozenset(out)

    def __or__(self, other: Scope) -> Scope:
        return Scope(
            tuple(dict.fromkeys(self.bases + other.bases)),
            self.files | other.files,
            self.trees | other.trees,
        )


def patch_of(operation: str) -> str | None:
    """The patch a record's ``operation`` ("apply of NAME") is about."""
    found = _LABEL.match(operation)
    return found["patch"] if found else None


def read_record(journal: Path) -> dict:
    """The record at ``journal``, its shape checked (not yet its paths)."""
    looked_for = "the JSON record vllm-patch writes before it renames files"
    try:
        record = read_json(journal, looked_for)
    except PatchError as exc:
        record, found = None, f"{exc.message}: {exc.found or ''}"
    else:
        found = "a JSON document of another shape"
    if not _valid_record(record):
        raise PatchError(
            "unreadable record of an interrupted operation",
            path=str(journal),
            looked_for=looked_for,
            found=f"{found}; the files it names are left as they are: check "
            "them, then delete it",
        )
    return record


def _valid_record(record: object) -> bool:
    if not isinstance(record, dict) or not isinstance(record.get("operation"), str):
        return False
    lists = [record.get(k) for k in ("renames", "created_folders", "remove")]
    if not all(isinstance(v, list) for v in lists):
        return False
    return all(
        isinstance(e, dict) and all(isinstance(e.get(k), t) for k, t in _ENTRY.items())
        for e in record["renames"]
    ) and all(isinstance(p, str) for p in lists[1] + lists[2])


def check_record(record: dict, scope: Scope, source: Path | None = None) -> None:
    """Refuse a record naming anything but ``scope`` and the names derived from
    it; ``source``: the record's file, when it was read from one."""
    refuse = _refuser(record, source)
    for entry in record["renames"]:
        target = Path(entry["target"])
        refuse("target", entry["target"], target in scope.files)
        refuse("new", entry["new"], entry["new"] == str(sibling(target, NEW)))
        old = entry["old"]
        refuse("old", old, old is None or old == str(sibling(target, OLD)))
        refuse("sha256", entry["sha256"], bool(_SHA256.match(entry["sha256"])))
    folders = scope.folders()
    for folder in record["created_folders"]:
        refuse("created folder", folder, Path(folder) in folders)
    for folder in record["remove"]:
        refuse("folder to remove", folder, Path(folder) in scope.trees)


def _refuser(record: dict, source: Path | None) -> Callable[[str, object, bool], None]:
    def refuse(key: str, value: object, ok: bool) -> None:
        if ok:
            return
        where = f"the record {source}" if source else "a write"
        raise PatchError(
            f"{where} names a path outside what {record['operation']} touches",
            path=str(source) if source else str(value),
            looked_for="only the files of that patch in this tree, their "
            "backups, and the .new/.old names vllm-patch gives them",
            found=f"{key} {str(value)[:300]!r}; nothing was changed"
            + ("; delete the record if you did not expect it" if source else ""),
        )

    return refuse


def names(scope_files: Iterable[Path]) -> list[Path]:
    """Every name a write of ``scope_files`` may leave: their ``NEW``/``OLD``."""
    return [sibling(p, s) for p in sorted(scope_files) for s in (NEW, OLD)]
