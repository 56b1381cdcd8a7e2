"""Backups of original files for installed trees (site-packages, unpacked
wheels), so ``revert`` restores their exact bytes. Checkouts have git and get
the inverse edit instead.

Layout: ``<tree>/.vllm-patch-backup/<patch>/manifest.json`` and the original
files beside it under their tree paths. The manifest maps each backed-up file
to ``{"original_sha256": ..., "patched_sha256": ...}``.

A backup can be damaged (a copy deleted or edited, the manifest emptied or
replaced, a folder where a copy was). Reading one never fails: every entry that
does not hold up is reported in ``problems`` and left out, and the engine falls
back to the inverse edit for its file.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from patcher.atomic import sha256
from patcher.errors import PatchError
from patcher.files import kind, read_regular

BACKUP_DIR = ".vllm-patch-backup"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
HASHES = ("original_sha256", "patched_sha256")


@dataclass(frozen=True)
class BackupState:
    entries: dict[str, dict[str, str]] = field(default_factory=dict)
    """relpath -> hashes, only entries whose copy is present and intact."""
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class Backup:
    folder: Path

    @classmethod
    def of(cls, tree_root: Path, patch_name: str) -> Backup:
        return cls(tree_root / BACKUP_DIR / patch_name)

    @property
    def manifest_path(self) -> Path:
        return self.folder / "manifest.json"

    def copy_path(self, relpath: str) -> Path:
        return self.folder / relpath

    def exists(self) -> bool:
        return os.path.lexists(self.folder)

    def read(self) -> BackupState:
        """The usable entries and what is wrong with the rest."""
        if not self.exists():
            return BackupState()
        try:
            manifest = json.loads(read_regular(self.manifest_path).decode("utf-8"))
        except (PatchError, ValueError) as exc:
            reason = exc.message if isinstance(exc, PatchError) else str(exc)
            return BackupState(problems=(f"{self.manifest_path}: {reason}",))
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict):
            return BackupState(
                problems=(
                    f'{self.manifest_path}: no "files" table (found '
                    f"{json.dumps(manifest)[:60]})",
                )
            )
        entries, problems = {}, []
        for relpath, entry in files.items():
            problem = self._check(relpath, entry)
            if problem:
                problems.append(problem)
            else:
                entries[relpath] = {k: entry[k] for k in HASHES}
        return BackupState(entries, tuple(problems))

    def _check(self, relpath: str, entry: object) -> str | None:
        where = f"{self.manifest_path}: entry {relpath!r}"
        if not isinstance(entry, dict):
            return f"{where} is not a table"
        for key in HASHES:
            if not _SHA256.match(str(entry.get(key, ""))):
                return f"{where} has no valid {key}"
        copy = self.copy_path(relpath)
        if not copy.resolve().is_relative_to(self.folder.resolve()):
            return f"{where} points outside the backup"
        try:
            data = read_regular(copy)
        except PatchError as exc:
            return f"{copy}: {exc.message}" + (f" ({exc.found})" if exc.found else "")
        if sha256(data) != entry["original_sha256"]:
            return f"{copy}: changed since it was backed up (hash differs)"
        return None

    def files_to_write(
        self, changes: dict[str, tuple[bytes, bytes]], state: BackupState
    ) -> dict[Path, bytes]:
        """What to add to the write for ``changes`` (relpath -> (before, after)).

        A file already backed up keeps its first original (a half-applied tree
        completed later still reverts to what it was before any patching), unless
        the file now is something else (vLLM reinstalled): then it is backed up anew.
        """
        manifest = dict(state.entries)
        out: dict[Path, bytes] = {}
        for relpath, (before, after) in changes.items():
            entry = manifest.get(relpath)
            if entry is None or entry["original_sha256"] != sha256(before):
                copy = self.copy_path(relpath)
                if os.path.lexists(copy) and not copy.is_file():
                    raise PatchError(
                        "damaged backup: the place of a backup copy is taken",
                        path=str(copy),
                        looked_for=f"nothing, or the backup copy of {relpath}",
                        found=f"{kind(os.lstat(copy).st_mode)}; delete it and run "
                        "again",
                    )
                out[copy] = before
                entry = {"original_sha256": sha256(before)}
            manifest[relpath] = {**entry, "patched_sha256": sha256(after)}
        body = {"files": manifest}
        out[self.manifest_path] = (json.dumps(body, indent=2) + "\n").encode()
        return out

    @staticmethod
    def restorable(state: BackupState, relpath: str, current: bytes) -> bool:
        """Is the file still exactly as apply left it, with its copy intact?"""
        entry = state.entries.get(relpath)
        return entry is not None and entry["patched_sha256"] == sha256(current)

    def original(self, relpath: str) -> bytes:
        return read_regular(self.copy_path(relpath))

    def removals(self) -> list[Path]:
        """What ``write_atomically(remove=...)`` deletes to discard the backup."""
        return [self.folder] if self.exists() else []
