"""Backups of original files for installed trees (site-packages, unpacked
wheels), so ``revert`` restores their exact bytes. Checkouts have git and get
the inverse edit instead.

Layout: ``<tree>/.vllm-patch-backup/<patch>/manifest.json`` and the original
files beside it under their tree paths. The manifest maps each backed-up file
to ``{"original_sha256": ..., "patched_sha256": ...}``.

A backup can be damaged (a copy deleted or edited, the manifest emptied or
replaced, a folder where a copy was). Reading one never fails for that: every
entry that does not hold up is reported in ``problems`` and left out, and the
engine falls back to the inverse edit for its file.

A backup can also be planted, by whoever prepared the tree, to make vllm-patch
act elsewhere: the store (or a folder in it) a link out of the tree, a manifest
naming files the patch does not touch, a ``.git`` file pointing at another
folder. Those are refused (``PatchError``, exit 3) before anything is read or
written through them.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from patcher.atomic import sha256
from patcher.confine import real, refuse_links
from patcher.errors import PatchError, ReadError
from patcher.files import kind, read_json, read_regular

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
    base: Path
    """Where the store lives, resolved: the tree root, or a checkout's git dir."""
    patch: str
    files: frozenset[str] = frozenset()
    """The tree paths the patch touches: the only entries a manifest may have."""

    @classmethod
    def of(cls, base: Path, patch_name: str, files=frozenset()) -> Backup:
        """The patch's backup under ``base``, refused when any part of the
        store is a link (it would lead the writes and deletes elsewhere)."""
        backup = cls(real(base), patch_name, frozenset(files))
        for path in [backup.folder, backup.manifest_path]:
            refuse_links(path, backup.base, "part of the backup store")
        return backup

    @property
    def folder(self) -> Path:
        return self.base / BACKUP_DIR / self.patch

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
            manifest = read_json(self.manifest_path, "the backup's manifest")
        except ReadError:
            raise
        except PatchError as exc:
            reason = f"{exc.message} ({exc.found})" if exc.found else exc.message
            return BackupState(problems=(f"{self.manifest_path}: {reason}",))
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict):
            return BackupState(
                problems=(
                    f'{self.manifest_path}: no "files" table (found a '
                    f"{type(manifest).__name__})",
                )
            )
        self._refuse_foreign(files)
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
        refuse_links(copy, self.base, "part of the backup store")
        try:
            data = read_regular(copy)
        except ReadError:
            raise
        except PatchError as exc:
            return f"{copy}: {exc.message}" + (f" ({exc.found})" if exc.found else "")
        if sha256(data) != entry["original_sha256"]:
            return f"{copy}: changed since it was backed up (hash differs)"
        return None

    def _refuse_foreign(self, files: dict) -> None:
        """A manifest entry for a file the patch does not touch is not damage
        but a plant: revert would copy it over whatever it names."""
        for relpath in files:
            if relpath not in self.files:
                raise PatchError(
                    "a backup manifest names a file the patch does not touch",
                    path=str(self.manifest_path),
                    looked_for=f"entries for {', '.join(sorted(self.files))} only",
                    found=f"entry {relpath[:300]!r}; nothing was changed: delete "
                    f"{self.folder} if you did not make it",
                )

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
        refuse_links(self.copy_path(relpath), self.base, "part of the backup store")
        return read_regular(self.copy_path(relpath))

    def removals(self) -> list[Path]:
        """What ``write_atomically(remove=...)`` deletes to discard the backup."""
        return [self.folder] if self.exists() else []


def git_dir(root: Path) -> Path:
    """The git directory of the checkout at ``root`` (resolved), where its
    backups live: ``.git`` itself, or the folder a ``.git`` file names when that
    is a git directory of this very checkout (a linked work tree's, or a
    submodule's). Anything else is refused: it would put the backups elsewhere."""
    dot = root / ".git"
    mode = os.lstat(dot).st_mode
    if stat.S_ISDIR(mode):
        return dot
    if stat.S_ISREG(mode):
        text = read_regular(dot, limit=4096).decode("utf-8", "replace")
        key, _, value = text.partition(":")
        if key.strip() == "gitdir" and value.strip():
            found = real(root / value.strip())
            if _belongs_to(found, root):
                return found
            raise _foreign_git(dot, f"gitdir: {found}, not a git directory of it")
    raise _foreign_git(dot, kind(mode) if not stat.S_ISREG(mode) else "no gitdir")


def _belongs_to(gitdir: Path, root: Path) -> bool:
    """Is ``gitdir`` a git directory whose work tree is ``root``?"""
    if not (gitdir / "HEAD").is_file():
        return False
    back = gitdir / "gitdir"  # a linked work tree's: the path of its .git file
    if back.is_file():
        line = read_regular(back, limit=4096).decode("utf-8", "replace").strip()
        return real(gitdir / line) == real(root / ".git")
    config = gitdir / "config"  # a submodule's: core.worktree
    if config.is_file():
        text = read_regular(config).decode("utf-8", "replace")
        found = re.search(r"^\s*worktree\s*=\s*(.+?)\s*$", text, re.MULTILINE)
        return bool(found) and real(gitdir / found[1]) == real(root)
    return False


def _foreign_git(dot: Path, found: str) -> PatchError:
    return PatchError(
        "a .git that is not this checkout's git directory",
        path=str(dot),
        looked_for="a .git folder, or a .git file naming a git directory of this "
        "work tree (git worktree, submodule)",
        found=f"{found}; nothing was changed",
    )
