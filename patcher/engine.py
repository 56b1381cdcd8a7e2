"""Plan, apply and revert patches on a vLLM tree: a codemod runner.

Read, plan in memory (each edit's codemod turns the tree's text into new text),
then write each changed file by atomic replace (``files.replace_at``). Every
codemod is idempotent and finishes a half-made change, so a kill between two
files leaves a tree the next ``apply`` completes or ``revert`` undoes, and that
``check`` reports as ``partly applied``. A tree that is not a git checkout also
keeps plain copies of its originals (``backup``), for a byte-exact revert.
Only ``apply`` and ``revert`` write, one writer at a time (``files.locked``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from packaging.version import Version

from patcher.backup import Backup, sha256
from patcher.diff import combined_diff
from patcher.errors import PatchError, shown
from patcher.files import locked, remove_at, replace_at
from patcher.patchset import Edit, Patch, defaults, exclusive_with, is_default, select
from patcher.shim import follow
from patcher.status import PlanStatus
from patcher.tree import VllmTree, refuse_wheel
from patcher.version import VERSION_FILE, read_version

Direction = Literal["apply", "revert"]
TESTS_FOLDER = "tests"
"""A tree with this folder beside ``vllm/`` (a checkout) also gets the test edits."""


@dataclass(frozen=True)
class EditPlan:
    edit: Edit
    before: str | None = None
    """The file's text before the edit; None: absent (an edit that creates it)."""
    after: str | None = None
    """Its text after; None: absent (revert deletes a file apply created)."""
    error: PatchError | None = None
    described: tuple[str, ...] = ()
    """What the codemod changed, one sentence each (see ``TreeCodemod.record``)."""
    skipped: PatchError | None = None
    """Why an optional edit is left out (its file is missing or unrecognised)."""
    path: str | None = None
    """The file edited, when ``edit.file`` is a compatibility shim pointing to it."""

    @property
    def file(self) -> str:
        return self.path or self.edit.file

    @property
    def via(self) -> str | None:
        """The shim that led to :attr:`file`, if any."""
        return self.edit.file if self.path else None

    @property
    def reason(self) -> str | None:
        """Why the edit is refused or left out, if it is."""
        why = self.error or self.skipped
        return str(why) if why else None

    @property
    def changes(self) -> bool:
        return self.error is None and self.skipped is None and self.before != self.after

    def status(self, direction: Direction = "apply") -> PlanStatus:
        if self.skipped is not None:
            return PlanStatus.SKIPPED
        if self.error is not None:
            return PlanStatus.NOT_APPLICABLE
        return PlanStatus.pending(direction, self.changes)


@dataclass(frozen=True)
class PatchPlan:
    patch: Patch
    tree: VllmTree
    direction: Direction
    version: Version | None
    edits: tuple[EditPlan, ...]
    error: PatchError | None = None
    """A whole-patch refusal (version out of range, an exclusive patch present)."""
    warnings: tuple[str, ...] = ()
    sources: Mapping[str, str | None] = field(default_factory=dict, repr=False)
    """Every file the plan read (relpath -> text, None: absent): a plan made
    earlier is written only while the tree still holds these."""

    @property
    def errors(self) -> list[PatchError]:
        found = [self.error] if self.error else []
        return found + [e.error for e in self.edits if e.error is not None]

    @property
    def status(self) -> PlanStatus:
        """``not applicable``; ``applicable``, ``partly applied`` or ``applied``
        (apply); ``revertible`` or ``not applied`` (revert)."""
        if self.errors:
            return PlanStatus.NOT_APPLICABLE
        made = [e.changes for e in self.edits if e.skipped is None]
        if self.direction == "apply" and any(made) and not all(made):
            return PlanStatus.PARTLY_APPLIED
        return PlanStatus.pending(self.direction, any(made))

    @property
    def skipped(self) -> list[EditPlan]:
        """Optional edits left out, each with its reason."""
        return [e for e in self.edits if e.skipped is not None]

    def file_changes(self) -> dict[str, tuple[str | None, str | None]]:
        """relpath -> (text before the patch, text after all its edits); None
        for a file that is absent."""
        out: dict[str, tuple[str | None, str | None]] = {}
        for e in self.edits:
            if e.error is None and e.skipped is None:
                first = out[e.file][0] if e.file in out else e.before
                out[e.file] = (first, e.after)
        return {k: v for k, v in out.items() if v[0] != v[1]}

    def described(self) -> dict[str, list[str]]:
        """relpath -> what the edits changed in it, one sentence each (Markdown)."""
        out: dict[str, list[str]] = {}
        for e in self.edits:
            if e.changes:
                out.setdefault(e.file, []).extend(e.described)
        return out

    def diff(self) -> str:
        return combined_diff((rel, a, b) for rel, (a, b) in self.file_changes().items())

    def to_json(self) -> dict:
        return {
            "patch": self.patch.name,
            "title": self.patch.title,
            "tree": str(self.tree.location),
            "vllm_version": str(self.version) if self.version else None,
            "status": self.status,
            "error": str(self.error) if self.error else None,
            "warnings": list(self.warnings),
            "edits": [
                {
                    "file": e.file,
                    "via": e.via,
                    "summary": e.edit.summary,
                    "status": e.status(self.direction),
                    "reason": e.reason,
                    "changes": list(e.described) if e.changes else [],
                }
                for e in self.edits
            ],
        }


def choose(tree: VllmTree, names: list[str] | None, direction: Direction = "apply"):
    """The patches a command acts on: the named ones, else the tree's defaults
    (``patchset.is_default``); a plain revert also takes every other patch in
    range that is there to revert."""
    if names:
        return select(names)
    version = read_version(tree)
    if direction == "apply":
        chosen = defaults(version)
        if not chosen:
            why = "; ".join(f"{p.name}: {is_default(p, version)[1]}" for p in select(None))
            raise PatchError(
                "no patch is this tree's default (pass --patch NAME)",
                path=str(tree.location),
                looked_for="a patch whose default range holds",
                found=why,
            )
        return chosen
    return [
        p
        for p in select(None)
        if p.covers(version)
        and (is_default(p, version)[0] or _present(plan(tree, p, "revert")))
    ]


def _present(p: PatchPlan) -> bool:
    return not p.errors and p.status is PlanStatus.REVERTIBLE


def check(
    tree: VllmTree, patches: Iterable[Patch], direction: Direction = "apply", **kw
) -> list[PatchPlan]:
    """Each patch planned under a shared lock: never on a tree another
    vllm-patch is half-way through writing."""
    if tree.is_wheel:
        return [plan(tree, p, direction, **kw) for p in patches]
    with locked(tree.location, shared=True):
        return [plan(tree, p, direction, **kw) for p in patches]


def plan(
    tree: VllmTree,
    patch: Patch,
    direction: Direction = "apply",
    *,
    force: bool = False,
    restore: Mapping[str, str] | None = None,
) -> PatchPlan:
    """What ``direction`` would do to ``tree``; nothing is written. ``restore``
    (relpath -> original text): files revert gives back from a backup."""
    version = read_version(tree)
    warnings: list[str] = []
    if version is None:
        warnings.append(
            f"{tree.location}: no readable vLLM version ({VERSION_FILE}, dist-info or "
            "wheel name); judging by the source's shape alone"
        )
    refusal = None
    if direction == "apply" and not patch.covers(version):
        refusal = PatchError(
            "vLLM version outside the patch's range (--force overrides)",
            path=str(tree.location),
            looked_for=f"vllm{patch.versions}",
            found=str(version),
        )
        if force:
            warnings.append(f"{refusal.message}: {version} not in {patch.versions}; forced")
            refusal = None
    refusal = refusal or (_exclusive(tree, patch) if direction == "apply" else None)
    if refusal is not None:
        return PatchPlan(patch, tree, direction, version, (), refusal, tuple(warnings))
    sources: dict[str, str | None] = {}
    tests = patch.test_edits if tree.has_folder(TESTS_FOLDER) else ()
    edits = tuple(_plan_edits(tree, patch.edits + tests, direction, sources, restore))
    warnings += [f"{e.edit.file} left out: {e.skipped}" for e in edits if e.skipped]
    return PatchPlan(
        patch, tree, direction, version, edits, None, tuple(warnings), sources
    )


def _exclusive(tree: VllmTree, patch: Patch) -> PatchError | None:
    """The refusal to apply ``patch`` where a patch exclusive with it is there."""
    for other in exclusive_with(patch):
        if _present(plan(tree, other, "revert")):
            return PatchError(
                f"{other.name} is applied here (fully or in part), and {patch.name} "
                "excludes it",
                path=str(tree.location),
                looked_for=f"a tree without {other.name}",
                found=f"{other.name}'s edits; `vllm-patch revert --patch "
                f"{other.name}` takes them out",
            )
    return None


def _plan_edits(tree, edits: Iterable[Edit], direction, sources, restore):
    """Each edit planned; ``sources`` collects every file read (relpath -> text)."""

    def read(rel: str) -> str | None:
        if rel not in sources:
            sources[rel] = tree.read_text(rel) if tree.exists(rel) else None
        return sources[rel]

    def read_file(rel: str) -> str:
        return read(follow(tree, rel)) or ""

    texts: dict[str, str | None] = {}  # files as edited so far: edits chain
    for edit in edits:
        if not (edit.create or tree.exists(edit.file)) and edit.optional:
            skipped = PatchError("not in this tree", path=tree.display(edit.file))
            yield EditPlan(edit, skipped=skipped)
            continue
        path = edit.file
        try:
            path = follow(tree, edit.file)
            before = texts[path] if path in texts else read(path)
            if before is None and not edit.create:
                tree.read_text(path)  # the error naming the missing file
            after, described = _edit(edit, direction, before, read_file, restore, path)
        except PatchError as exc:
            if exc.path == edit.file:
                exc.path = shown(tree.display(path))
            yield EditPlan(edit, **{"skipped" if edit.optional else "error": exc})
            continue
        texts[path] = after
        shim = path if path != edit.file else None
        yield EditPlan(edit, before, after, described=described, path=shim)


def _edit(edit, direction, before, read_file, restore, path):
    """(text after the edit, what it changed), running its codemod."""
    from patcher.codemod import run_codemod_described  # LibCST: only when run

    if direction == "revert" and restore and path in restore:
        if before == restore[path]:
            return before, ()
        return restore[path], ("Restored from the backup.",)
    if direction == "apply":
        return run_codemod_described(edit.apply, before or "", read_file)
    if before is None:
        return None, ()
    if edit.create and before == run_codemod_described(edit.apply, "", read_file)[0]:
        return None, ("Deleted the file apply created.",)
    return run_codemod_described(edit.revert, before, read_file)


@dataclass(frozen=True)
class Outcome:
    patch: str
    action: str
    files: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    """What the engine found besides the patch: a damaged backup, a plan made
    again. (What the plan warned about is ``PatchPlan.warnings``.)"""

    def __str__(self) -> str:
        where = f" ({', '.join(self.files)})" if self.files else ""
        return f"{self.patch}: {self.action}{where}"


def _backup(tree: VllmTree, patch: Patch) -> Backup | None:
    """Where the originals are kept: in the tree, or in a checkout's own git
    directory (a ``.git`` folder; a linked work tree has none of its own)."""
    base = tree.location / (".git" if tree.kind == "checkout" else "")
    if not stat.S_ISDIR(os.lstat(base).st_mode):
        return None
    files = {e.file for e in patch.edits + patch.test_edits}
    files |= {follow(tree, f) for f in files if tree.exists(f)}
    return Backup(tree.real(os.path.relpath(base, tree.location)), patch.name, frozenset(files))


def _inverse_restores(tree: VllmTree, p: PatchPlan) -> bool:
    """Whether the inverse edits alone turn every changed file back (a checkout
    then needs no backup): not when part of the change was there already."""
    changes = p.file_changes()
    texts = {rel: after for rel, (_, after) in changes.items()}
    sources = {**p.sources, **texts}
    try:
        reverted = _plan_edits(tree, p.patch.edits + p.patch.test_edits, "revert", sources, None)
        for e in reverted:
            if e.file in texts and e.error is None and e.skipped is None:
                texts[e.file] = e.after
    except PatchError:
        return False
    return all(texts[rel] == before for rel, (before, _) in changes.items())


def apply(
    tree: VllmTree, patch: Patch, *, force: bool = False, planned: PatchPlan | None = None
) -> Outcome:
    """Apply ``patch`` to ``tree``. ``planned``: the caller's own plan of it,
    written as it is unless the tree no longer holds what it was made from
    (another writer came between); then, and without it, planned here."""
    refuse_wheel(tree.location, "apply to")
    notes: list[str] = []
    with locked(tree.location):
        _clean(tree, patch)
        if planned is None or not _still_current(tree, planned):
            if planned is not None:
                notes.append(f"{patch.name}: the tree changed after the check; planned again")
            planned = plan(tree, patch, "apply", force=force)
        if planned.errors:
            raise planned.errors[0]
        changes = planned.file_changes()
        _refuse_read_only(tree, changes)
        backup = _backup(tree, patch) if changes else None
        if backup and (tree.kind == "installed" or not _inverse_restores(tree, planned)):
            entries, problems = backup.read()
            notes += [f"damaged backup, entry left out: {p}" for p in problems]
            originals = {r: (a, b) for r, (a, b) in changes.items() if a is not None}
            backup.save(entries, {r: (a.encode(), b.encode()) for r, (a, b) in originals.items()})
        _write(tree, changes)
    if not changes:
        return Outcome(patch.name, "already applied", (), tuple(notes))
    partly = any(not e.changes for e in planned.edits if e.skipped is None)
    action = "completed" if partly else "applied"
    return Outcome(patch.name, action, _shown(planned, changes), tuple(notes))


def _clean(tree: VllmTree, patch: Patch) -> None:
    """Delete what an interrupted write of the patch's files left beside them."""
    for rel in {follow(tree, e.file) for e in patch.edits + patch.test_edits}:
        remove_at(tree.real(rel), leftovers=True)


def _still_current(tree: VllmTree, p: PatchPlan) -> bool:
    """Whether ``tree`` still holds the version and every file text ``p`` read."""
    try:
        return read_version(tree) == p.version and all(
            (tree.read_text(rel) if tree.exists(rel) else None) == text
            for rel, text in p.sources.items()
        )
    except PatchError:  # a file gone or unreadable: the new plan says which
        return False


def _write(tree: VllmTree, changes: Mapping[str, tuple[str | None, str | None]]) -> None:
    """Each file replaced (or deleted) on its own; a failure says how far it got."""
    paths = {rel: tree.real(rel) for rel in changes}
    done = 0
    for rel, (_, after) in changes.items():
        try:
            if after is None:
                remove_at(paths[rel])
            else:
                replace_at(paths[rel], after.encode())
        except OSError as exc:
            raise PatchError(
                f"cannot write ({exc.strerror})",
                path=tree.display(rel),
                looked_for="a file vllm-patch may replace",
                found=f"{done} of {len(changes)} files written; the tree is partly "
                "patched: run apply again to finish, or revert to undo",
            ) from exc
        done += 1


def _refuse_read_only(tree: VllmTree, changes: Iterable[str]) -> None:
    """Files and folders marked read-only are left alone, even by root."""
    paths = [tree.real(rel) for rel in changes]
    if not paths:
        return
    for target in {tree.real("."), *paths, *(p.parent for p in paths)}:
        if not os.path.lexists(target):
            continue
        mode = os.stat(target).st_mode
        if not os.access(target, os.W_OK) or not mode & 0o222:
            what = "folder" if target.is_dir() else "file"
            raise PatchError(
                f"{what} is read-only",
                path=str(target),
                looked_for=f"a writable {what}",
                found=f"mode {stat.filemode(mode)}",
            )


def _shown(p: PatchPlan, changes) -> tuple[str, ...]:
    """The changed files, each with the shim that led to it."""
    via = {e.file: e.via for e in p.edits if e.via}
    return tuple(f"{r} via the shim {via[r]}" if r in via else r for r in changes)


def revert(tree: VllmTree, patch: Patch) -> Outcome:
    """Undo ``patch``: each file as apply left it from its backup copy, every
    other file by the inverse edits; then the backup is deleted."""
    refuse_wheel(tree.location, "revert")
    with locked(tree.location):
        _clean(tree, patch)
        backup = _backup(tree, patch)
        entries, problems = backup.read() if backup else ({}, [])
        restore = {}
        for rel, entry in entries.items():
            if tree.exists(rel) and sha256(tree.read_bytes(rel)) == entry["patched_sha256"]:
                restore[rel] = backup.original(rel).decode("utf-8")
        p = plan(tree, patch, "revert", restore=restore)
        notes = [f"damaged backup, reverting by the inverse edit instead: {x}" for x in problems]
        if p.errors and problems:
            error = p.errors[0]
            raise PatchError(
                "cannot revert: the backup is damaged and the inverse edit does not "
                f"recognise the file ({error.message})",
                path=error.path,
                looked_for=error.looked_for,
                found=f"{error.found}; backup: {'; '.join(problems)}. Reinstall "
                f"vLLM to get the original file back, then delete {backup.folder}",
            )
        if p.errors:
            raise p.errors[0]
        changes = p.file_changes()
        _refuse_read_only(tree, changes)
        _write(tree, changes)
        if backup is not None:
            backup.discard()
    action = "reverted" if changes else "nothing to revert"
    return Outcome(patch.name, action, _shown(p, changes), tuple(notes))
