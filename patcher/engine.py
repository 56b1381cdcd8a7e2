"""A one-way codemod runner: ``plan`` runs each codemod once, in memory;
``apply(tree, plan)`` writes exactly that plan or refuses. The originals go to a
backup first, so the inverse codemods need only be right in meaning."""

import contextlib
import difflib
import os
import stat
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Literal

from packaging.version import Version

from patcher.backup import Backup, hex_digest
from patcher.errors import PatchError, VllmHasItsOwn, printable
from patcher.files import locked, remove_at, replace_at
from patcher.patchset import (
    Edit,
    Patch,
    defaults,
    exclusive_with,
    is_default,
    select,
)
from patcher.status import PlanStatus
from patcher.tree import VllmTree, refuse_wheel
from patcher.version import VERSION_FILE, read_version

Direction = Literal["apply", "revert"]
Text = str | None  # a file's text; None: absent (an edit with ``create = true``)
DAMAGED = "damaged backup"
NO_NEWLINE = "\n\\ No newline at end of file\n"  # as git diff marks a last line


@dataclass(frozen=True)
class EditPlan:
    edit: Edit
    before: Text = None
    after: Text = None
    error: PatchError | None = None
    said: tuple[str, ...] = ()  # what the codemod changed (``TreeCodemod.record``)
    skipped: PatchError | None = None  # why an optional edit is left out
    own: str | None = None  # vLLM's own form of the change (``VllmHasItsOwn``)

    @property
    def file(self) -> str:
        return self.edit.file

    @property
    def reason(self) -> str | None:
        why = self.error or self.skipped or self.own
        return str(why) if why else None

    @property
    def changes(self) -> bool:
        return not (self.error or self.skipped) and self.before != self.after

    def status(self, direction: Direction = "apply") -> PlanStatus:
        if self.skipped or self.error:
            return PlanStatus.SKIPPED if self.skipped else PlanStatus.NOT_APPLICABLE
        if self.own:
            return PlanStatus.IN_VLLM
        return PlanStatus.from_changes(direction, self.changes)


@dataclass(frozen=True)
class PatchPlan:
    patch: Patch
    tree: VllmTree
    direction: Direction
    version: Version | None
    edits: tuple[EditPlan, ...]
    error: PatchError | None = None  # a whole-patch refusal (version out of range)
    warnings: Sequence[str] = ()
    sources: Mapping[str, Text] = field(default_factory=dict, repr=False)
    """Every file the plan read: it is written only while the tree holds these."""

    @property
    def errors(self) -> list[PatchError]:
        return [x for x in (self.error, *(e.error for e in self.edits)) if x]

    @property
    def status(self) -> PlanStatus:
        if self.errors:
            return PlanStatus.NOT_APPLICABLE
        if self.in_vllm:
            return PlanStatus.IN_VLLM
        made = [e.changes for e in self.edits if e.skipped is None]
        if self.direction == "apply" and any(made) and not all(made):
            return PlanStatus.PARTLY_APPLIED
        return PlanStatus.from_changes(self.direction, any(made))

    @property
    def in_vllm(self) -> bool:
        """vLLM has its own form of the change in a file:
        the patch writes nothing."""
        return any(e.own for e in self.edits)

    @property
    def skipped(self) -> list[EditPlan]:
        return [e for e in self.edits if e.skipped is not None]

    def file_changes(self) -> dict[str, tuple[Text, Text]]:
        """relpath -> (text before the patch, text after all its edits)."""
        made = [e for e in self.edits if not (e.error or e.skipped or self.in_vllm)]
        after = {e.file: e.after for e in made}  # edits of one file chain: the last
        before = self.sources
        return {f: (before[f], a) for f, a in after.items() if a != before[f]}

    def described(self) -> dict[str, list[str]]:
        """relpath -> what the edits changed in it, one sentence each (Markdown)."""
        out: dict[str, list[str]] = {}
        for e in self.edits:
            if e.changes:
                out.setdefault(e.file, []).extend(e.said)
        return out

    def diff(self) -> str:
        """A unified diff ``git apply`` accepts (line endings kept)."""
        out = []
        for rel, (before, after) in self.file_changes().items():
            out += [f"diff --git a/{rel} b/{rel}\n"]
            out += ["new file mode 100644\n"] if before is None else []
            out += ["deleted file mode 100644\n"] if after is None else []
            for line in difflib.unified_diff(
                (before or "").splitlines(keepends=True),
                (after or "").splitlines(keepends=True),
                "/dev/null" if before is None else f"a/{rel}",
                "/dev/null" if after is None else f"b/{rel}",
            ):
                end = "" if line.endswith("\n") else NO_NEWLINE
                out.append(line + end)
        return "".join(out)

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
                    "summary": e.edit.summary,
                    "status": e.status(self.direction),
                    "reason": e.reason,
                    "changes": list(e.said),
                }
                for e in self.edits
            ],
        }


def choose(
    tree: VllmTree, names: list[str] | None, direction: Direction = "apply"
) -> list[Patch]:
    """The named patches, else the tree's defaults (a plain revert: also those its
    backups show applied); refused while a patch it excludes is applied."""
    version = read_version(tree)
    if direction == "revert" and not names:
        covered = [p for p in select(None) if p.covers(version)]
        return [
            p
            for p in covered
            if is_default(p, version)[0] or _originals(tree, p)[0]
        ]
    chosen = select(names) if names else defaults(version)
    where = str(tree.location)
    if direction == "revert":
        return chosen
    if not chosen:
        why = "; ".join(
            f"{p.name}: {is_default(p, version)[1]}" for p in select(None)
        )
        message = "no patch is this tree's default (pass --patch NAME)"
        raise PatchError(message, where, "a patch whose default range holds", why)
    for patch in chosen:
        for other in exclusive_with(patch):
            if _originals(tree, other)[0]:
                applied = f"{other.name} is applied here (fully or in part)"
                message = f"{applied}, and {patch.name} excludes it"
                edits = f"its edits (`vllm-patch revert --patch {other.name}`)"
                wanted = f"a tree without {other.name}"
                raise PatchError(message, where, wanted, edits)
    return chosen


def plan_all(tree: VllmTree, patches: Iterable[Patch], **kw) -> list[PatchPlan]:
    """Each patch planned under a shared lock: never on a write half done."""
    with nullcontext() if tree.is_wheel else locked(tree.location, shared=True):
        return [plan(tree, p, **kw) for p in patches]


def plan(
    tree: VllmTree,
    patch: Patch,
    direction: Direction = "apply",
    *,
    force: bool = False,
) -> PatchPlan:
    """What ``direction`` would do to ``tree``, written nowhere."""
    version = read_version(tree)
    warnings = []
    where = str(tree.location)
    if version is None:
        warnings.append(
            f"{where}: no readable vLLM version ({VERSION_FILE}, dist-info or "
            "wheel name); judging by the source's shape alone"
        )
    if direction == "apply" and not patch.covers(version):
        message = "vLLM version outside the patch's range"
        refusal = PatchError(
            f"{message} (--force overrides)",
            where,
            f"vllm{patch.versions}",
            str(version),
        )
        if not force:
            return PatchPlan(patch, tree, direction, version, (), refusal, warnings)
        warnings.append(f"{message}: {version} not in {patch.versions}; forced")
    restore = {}
    if direction == "revert":
        restore, problems = _originals(tree, patch)
        warnings += [
            f"{DAMAGED}, reverting by the inverse edit: {x}" for x in problems
        ]
    sources: dict[str, Text] = {}
    tests = patch.test_edits if tree.has_folder("tests") else ()
    edits = tuple(
        _plan_edits(tree, patch.edits + tests, direction, sources, restore)
    )
    warnings += [f"{e.edit.file} left out: {e.skipped}" for e in edits if e.skipped]
    return PatchPlan(
        patch, tree, direction, version, edits, None, warnings, sources
    )


def _plan_edits(tree, edits: Iterable[Edit], direction, sources, restore):
    """Each edit planned, its codemod run once; ``sources`` gets every file read."""
    from patcher.codemod import run_codemod  # LibCST: only here

    def read(rel: str) -> str:  # a file of the tree ("": absent), noted in sources
        if rel not in sources:
            sources[rel] = _current(tree, rel)
        return sources[rel] or ""

    texts: dict[str, Text] = {}  # files as edited so far
    for edit in edits:
        path = edit.file
        said = []  # what the codemod changed, one sentence each
        if edit.optional and not (edit.create or tree.exists(path)):
            missing = PatchError("not in this tree", path=tree.display(path))
            yield EditPlan(edit, skipped=missing)
            continue
        try:
            read(path)
            before = texts.get(path, sources[path])
            if before is None and not edit.create:
                tree.read_text(path)  # the error naming the missing file
            if path in restore:
                after = restore[path]
                said = ["Restored from the backup."]
            elif direction == "apply":
                after = run_codemod(edit.apply, before or "", read, said)
            elif before is None:
                after = None
            elif edit.create and before == run_codemod(edit.apply, "", read):
                after = None
                said = ["Deleted the file apply created."]
            else:
                after = run_codemod(edit.revert, before, read, said)
        except VllmHasItsOwn as exc:
            yield EditPlan(edit, before, before, own=str(exc))
        except PatchError as exc:
            if exc.path == edit.file:
                exc.path = printable(tree.display(path))
            if edit.optional:  # a test edit: left out, and why
                yield EditPlan(edit, skipped=exc)
            else:
                yield EditPlan(edit, error=exc)
        else:
            texts[path] = after
            said = tuple(said) if after != before else ()
            yield EditPlan(edit, before, after, said=said)


def _current(tree: VllmTree, rel: str) -> Text:
    return tree.read_text(rel) if tree.exists(rel) else None


def _backup(tree: VllmTree, patch: Patch) -> Backup | None:
    """In a checkout's ``.git`` folder (none in a linked work tree),
    else the tree."""
    git = ".git" if os.path.lexists(tree.location / ".git") else "."
    if tree.is_wheel or not stat.S_ISDIR(os.lstat(tree.location / git).st_mode):
        return None
    return Backup(tree.real(git), patch.name, patch.files)


def _originals(tree: VllmTree, patch: Patch) -> tuple[dict[str, str], list[str]]:
    """rel -> original text of each file still as apply left it;
    the damage found."""
    backup = _backup(tree, patch)
    if backup is None:
        return {}, []
    entries, problems = backup.read()
    originals = {
        rel: entry["original"].decode("utf-8")
        for rel, entry in entries.items()
        if tree.exists(rel)
        and hex_digest(tree.read_bytes(rel)) == entry["patched_sha256"]
    }
    return originals, problems


@contextlib.contextmanager
def nothing_changed_on_error() -> Iterator[None]:
    """An ``OSError`` before any source is written: one message, nothing changed."""
    try:
        yield
    except OSError as exc:
        where = printable(exc.filename) if exc.filename else None
        message = f"cannot proceed ({exc.strerror or exc})"
        raise PatchError(message, where, found="nothing was changed") from exc


@dataclass(frozen=True)
class Outcome:
    patch: str
    action: str
    files: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # a damaged backup

    def __str__(self) -> str:
        where = f" ({', '.join(self.files)})" if self.files else ""
        return f"{self.patch}: {self.action}{where}"


def writer_lock(tree: VllmTree):
    """The one-writer lock on ``tree``: hold it from the plan to the write."""
    return locked(tree.location)


def apply(tree: VllmTree, planned: PatchPlan) -> Outcome:
    """Write ``planned`` as it is, or refuse when the tree no longer holds what it
    read; applying, the originals go to the backup first; reverted, it goes."""
    reverting = planned.direction == "revert"
    refuse_wheel(tree.location, "revert" if reverting else "apply to")
    patch = planned.patch
    changes = planned.file_changes()
    notes = [w for w in planned.warnings if w.startswith(DAMAGED)]
    # a revert neither the backup nor the codemod can do
    if planned.errors and notes:
        error = planned.errors[0]
        raise PatchError(
            "cannot revert: the backup is damaged and the inverse edit does not "
            f"recognise the file ({error.message})",
            error.path,
            error.looked_for,
            f"{error.found}; {'; '.join(notes)}. Reinstall vLLM to get the "
            f"original file back, then delete {_backup(tree, patch).folder}",
        )
    if planned.errors:
        raise planned.errors[0]
    with locked(tree.location):
        with nothing_changed_on_error():
            for rel in patch.files:  # what an interrupted write left beside them
                remove_at(tree.real(rel), leftovers=True)
            _refuse_stale_or_read_only(tree, planned, changes)
            backup = _backup(tree, patch) if changes or reverting else None
            if backup is not None and not reverting:
                entries, problems = backup.read()
                notes += [f"{DAMAGED}, entry left out: {p}" for p in problems]
                made = {r: (a, b) for r, (a, b) in changes.items() if a is not None}
                backup.save(entries, made)
        _write(tree, changes)
        try:
            if backup is not None and reverting:
                backup.discard()
        except OSError as exc:  # the sources are back: a stale store is harmless
            notes.append(f"{backup.folder}: not deleted ({exc.strerror})")
    if reverting:
        action = "reverted" if changes else "nothing to revert"
    elif not changes:
        action = (
            "in vLLM: nothing to apply" if planned.in_vllm else "already applied"
        )
    else:
        partly = planned.status is PlanStatus.PARTLY_APPLIED
        action = "completed" if partly else "applied"
    return Outcome(patch.name, action, tuple(changes), tuple(notes))


def revert(tree: VllmTree, patch: Patch) -> Outcome:
    """Undo ``patch``: from the backup, else by the inverse edits."""
    refuse_wheel(tree.location, "revert")
    with locked(tree.location):
        with nothing_changed_on_error():
            planned = plan(tree, patch, "revert")
        return apply(tree, planned)


def _refuse_stale_or_read_only(tree: VllmTree, planned: PatchPlan, changes) -> None:
    """Refused unless ``tree`` still holds every file ``planned`` read, and its
    version; and where a file or folder to write is read-only (even for root)."""
    same = False
    with contextlib.suppress(PatchError):  # a file gone or unreadable: changed
        same = read_version(tree) == planned.version and all(
            _current(tree, rel) == text for rel, text in planned.sources.items()
        )
    if not same:
        message = "the tree changed since it was planned; run again"
        wanted = f"the files {planned.patch.name} was planned on"
        found = "other contents; nothing was changed"
        raise PatchError(message, str(tree.location), wanted, found)
    paths = [tree.real(rel) for rel in changes]
    folders = {tree.real("."), *(path.parent for path in paths)} if paths else set()
    for target in folders | set(paths):
        mode = os.stat(target).st_mode if os.path.lexists(target) else None
        if mode is not None and not (mode & 0o222 and os.access(target, os.W_OK)):
            what = "folder" if stat.S_ISDIR(mode) else "file"
            found = f"mode {stat.filemode(mode)}"
            raise PatchError(
                f"{what} is read-only", str(target), f"a writable {what}", found
            )


def _write(tree: VllmTree, changes: Mapping[str, tuple[Text, Text]]) -> None:
    """Each file replaced (or deleted); a failure says how far it got."""
    for done, (rel, (_, after)) in enumerate(changes.items()):
        try:
            if after is None:
                remove_at(tree.real(rel))
            else:
                replace_at(tree.real(rel), after.encode())
        except OSError as exc:
            how_far = (
                f"{done} of {len(changes)} files written; the tree is partly "
                "patched: run apply again to finish, or revert to undo"
            )
            message = f"cannot write ({exc.strerror})"
            wanted = "a file vllm-patch may replace"
            found = how_far if done else "nothing was changed"
            raise PatchError(message, tree.display(rel), wanted, found) from exc
