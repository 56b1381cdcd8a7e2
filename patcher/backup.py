"""The originals in ``<home>/.vllm-patch-backup/<patch>/``, hashed in
``manifest.json``: ``revert`` gives their exact bytes back, and a tree shows which
patch it holds. Read as data: a bad entry is damage, left out; a link or a foreign
entry, refused."""

import contextlib
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from patcher.errors import PatchError
from patcher.files import MAX_FILE_BYTES, open_dir, read_at, remove_at, replace_at

BACKUP_DIR = ".vllm-patch-backup"
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
HASHES = ("original_sha256", "patched_sha256")


def hex_digest(data: bytes) -> str:
    """The SHA-256 of ``data`` in hex, as the manifest keeps it."""
    return hashlib.sha256(data).hexdigest()


class _Damage(PatchError):
    """A part of the store that does not hold up: reported, and left out."""


@dataclass(frozen=True)
class Backup:
    home: Path  # resolved: the tree's root, or a checkout's ``.git`` folder
    patch: str
    files: frozenset[str]  # the tree paths the patch touches: the only entries

    @property
    def folder(self) -> Path:
        return self.home / BACKUP_DIR / self.patch

    def original(self, rel: str, limit: int = MAX_FILE_BYTES) -> bytes:
        """``rel``'s copy, or the manifest: a link refused;
        anything else is damage."""
        path = self.folder / rel
        what = "the backup's manifest" if rel == MANIFEST else f"the copy of {rel}"
        try:
            return read_at(path, what, limit=limit)
        except PatchError as exc:
            if not str(exc.found).startswith("a symbolic link"):
                raise _Damage(f"{exc.path}: {exc.message} ({exc.found})") from exc
            message = "part of the backup store is a symbolic link (never followed)"
            found = f"{exc.found}; nothing was changed"
            raise PatchError(
                message, str(path), "a real folder or file", found
            ) from exc

    def read(self) -> tuple[dict[str, dict], list[str]]:
        """The intact entries (hashes; the copy's bytes as "original"),
        the damage."""
        if not os.path.lexists(self.folder.parent):
            return {}, []
        where = self.folder / MANIFEST
        try:
            data = json.loads(self.original(MANIFEST, MAX_MANIFEST_BYTES))
        except _Damage as exc:
            return {}, [str(exc)]
        except RecursionError:
            return {}, [f"{where}: JSON nested too deep"]
        except ValueError as exc:
            return {}, [f"{where}: {exc}"]
        files = data.get("files") if isinstance(data, dict) else None
        if not isinstance(files, dict):
            return {}, [f'{where}: no "files" table']
        foreign = [rel for rel in files if rel not in self.files]
        if foreign:
            message = "a backup manifest names a file the patch does not touch"
            wanted = f"entries for {', '.join(sorted(self.files))} only"
            found = (
                f"entry {foreign[0][:300]!r}; nothing was changed: delete "
                f"{self.folder} if you did not make it"
            )
            raise PatchError(message, str(where), wanted, found)
        entries = {}
        problems = []
        for rel, entry in files.items():
            said = f"{where}: entry {rel!r}"
            try:
                if not isinstance(entry, dict):
                    raise _Damage(f"{said} is not a table")
                bad = [k for k in HASHES if not _SHA256.match(str(entry.get(k)))]
                if bad:
                    raise _Damage(f"{said} has no valid {bad[0]}")
                original = self.original(rel)  # read once: checked, then restored
                if hex_digest(original) != entry["original_sha256"]:
                    raise _Damage(
                        f"{self.folder / rel}: changed since it was backed up"
                    )
                hashes = {k: entry[k] for k in HASHES}
                entries[rel] = {**hashes, "original": original}
            except _Damage as exc:
                problems.append(str(exc))
        return entries, problems

    def save(self, entries: dict, changes: dict[str, tuple[str, str]]) -> None:
        """Copy the originals of ``changes`` (rel -> (before, after)), then the
        manifest; ``entries`` stay, so a tree completed later reverts in full."""
        manifest = {rel: {k: e[k] for k in HASHES} for rel, e in entries.items()}
        for rel in [*changes, MANIFEST]:  # what a killed save left
            remove_at(self.folder / rel, leftovers=True)
        for rel, texts in changes.items():
            before, after = (t.encode() for t in texts)
            entry = manifest.get(rel)
            if entry is None or entry["original_sha256"] != hex_digest(before):
                try:
                    replace_at(self.folder / rel, before, make_below=self.home)
                except PatchError as exc:
                    message = "damaged backup: the place of a backup copy is taken"
                    wanted = f"nothing, or the backup copy of {rel}"
                    found = f"{exc.found}; delete it and run again"
                    where = str(self.folder / rel)
                    raise PatchError(message, where, wanted, found) from exc
                entry = {"original_sha256": hex_digest(before)}
            manifest[rel] = {**entry, "patched_sha256": hex_digest(after)}
        text = json.dumps({"files": manifest}, indent=2) + "\n"
        replace_at(self.folder / MANIFEST, text.encode(), make_below=self.home)

    def discard(self) -> None:
        """The manifest first (a kill then leaves copies no one reads), then all."""
        remove_at(self.folder / MANIFEST)
        remove_at(self.folder)
        with contextlib.suppress(OSError), open_dir(self.home) as fd:
            os.rmdir(BACKUP_DIR, dir_fd=fd)  # the store, once empty
