"""Backups of original files for installed trees (site-packages, unpacked
wheels), so ``revert`` restores their exact bytes. Checkouts have git and get
the inverse edit instead.

Layout: ``<tree>/.vllm-patch-backup/<patch>/manifest.json`` and the original
files beside it under their tree paths.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

BACKUP_DIR = ".vllm-patch-backup"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Backup:
    folder: Path

    @classmethod
    def of(cls, tree_root: Path, patch_name: str) -> Backup:
        return cls(tree_root / BACKUP_DIR / patch_name)

    @property
    def manifest_path(self) -> Path:
        return self.folder / "manifest.json"

    def manifest(self) -> dict[str, dict[str, str]]:
        if not self.manifest_path.is_file():
            return {}
        return json.loads(self.manifest_path.read_text("utf-8"))["files"]

    def files_to_write(
        self, changes: dict[str, tuple[bytes, bytes]]
    ) -> dict[Path, bytes]:
        """What to add to the write for ``changes`` (relpath -> (before, after)).

        A file already backed up keeps its first original: a half-applied tree
        completed later still reverts to what it was before any patching.
        """
        manifest = self.manifest()
        out: dict[Path, bytes] = {}
        for relpath, (before, after) in changes.items():
            entry = manifest.get(relpath)
            if entry is None:
                out[self.folder / relpath] = before
                entry = {"original_sha256": sha256(before)}
            manifest[relpath] = {**entry, "patched_sha256": sha256(after)}
        body = {"files": manifest}
        out[self.manifest_path] = (json.dumps(body, indent=2) + "\n").encode()
        return out

    def restorable(self, relpath: str, current: bytes) -> bytes | None:
        """The original bytes, if the file is still exactly as we left it."""
        entry = self.manifest().get(relpath)
        if entry is None or entry.get("patched_sha256") != sha256(current):
            return None
        original = (self.folder / relpath).read_bytes()
        return original if sha256(original) == entry["original_sha256"] else None

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        parent = self.folder.parent
        if parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
