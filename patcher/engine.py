"""Plan, apply and revert patches on a vLLM tree.

Data flows one way: a tree and its version come in, each edit's codemod turns
the tree's text into new text (nothing written), and only a complete, error-free
plan is written, atomically. A plan that fails anywhere writes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from packaging.version import Version

from patcher import atomic, known
from patcher.backup import Backup, BackupState, git_dir
from patcher.confine import is_inside, real
from patcher.diff import combined_diff
from patcher.errors import PatchError
from patcher.journal import Scope, patch_of
from patcher.patchset import Edit, Patch, all_patches
from patcher.shim import follow
from patcher.status import PlanStatus
from patcher.tree import VllmTree, refuse_wheel
from patcher.version import VERSION_FILE, read_version

Direction = Literal["apply", "revert"]
TESTS_FOLDER = "tests"
"""A tree with this folder beside ``vllm/`` (a checkout) also gets the test edits."""


def edits_for(tree: VllmTree, patch: Patch) -> tuple[Edit, ...]:
    """The patch's source edits, and its test edits where the tree has tests."""
    tests = patch.test_edits if tree.has_folder(TESTS_FOLDER) else ()
    return patch.edits + tests


@dataclass(frozen=True)
class EditPlan:
    edit: Edit
    before: str | None = None
    after: str | None = None
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
    """A whole-patch refusal (version out of range); edits then are empty."""
    warnings: tuple[str, ...] = ()
    sources: Mapping[str, str] = field(default_factory=dict, repr=False)
    """Every file the plan read (relpath -> text as read): a plan made earlier is
    written only while the tree still holds these (see :func:`apply`)."""

    @property
    def errors(self) -> list[PatchError]:
        found = [self.error] if self.error else []
        return found + [e.error for e in self.edits if e.error is not None]

    @property
    def status(self) -> PlanStatus:
        """``not applicable``; ``applicable`` or ``applied`` (apply);
        ``revertible`` or ``not applied`` (revert)."""
        if self.errors:
            return PlanStatus.NOT_APPLICABLE
        return PlanStatus.pending(self.direction, any(e.changes for e in self.edits))

    @property
    def skipped(self) -> list[EditPlan]:
        """Optional edits left out, each with its reason."""
        return [e for e in self.edits if e.skipped is not None]

    def file_changes(self) -> dict[str, tuple[str, str]]:
        """relpath -> (text before the patch, text after all its edits)."""
        out: dict[str, tuple[str, str]] = {}
        for e in self.edits:
            if e.error is None and e.skipped is None:
                first = out.get(e.file, (e.before, e.before))[0]
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


def plan(
    tree: VllmTree, patch: Patch, direction: Direction = "apply", *, force: bool = False
) -> PatchPlan:
    version, warnings, refusal = _version_check(tree, patch, force, direction)
    if refusal is not None:
        return PatchPlan(patch, tree, direction, version, (), refusal)
    sources: dict[str, str] = {}
    edits = tuple(_plan_edits(tree, edits_for(tree, patch), direction, sources))
    warnings += [f"{e.edit.file} left out: {e.skipped}" for e in edits if e.skipped]
    return PatchPlan(
        patch, tree, direction, version, edits, None, tuple(warnings), sources
    )


def _version_check(
    tree: VllmTree, patch: Patch, force: bool, direction: Direction = "apply"
) -> tuple[Version | None, list[str], PatchError | None]:
    """The tree's version, warnings about it, and the refusal to apply to a
    version outside the patch's range (None when in range, forced or reverting)."""
    version = read_version(tree)
    warnings: list[str] = []
    if version is None:
        warnings.append(
            f"{tree.location}: no readable vLLM version ({VERSION_FILE}, dist-info or "
            "wheel name); judging by the source's shape alone"
        )
    elif direction == "apply" and not patch.covers(version):
        refusal = PatchError(
            "vLLM version outside the patch's range (--force overrides)",
            path=str(tree.location),
            looked_for=f"vllm{patch.versions}",
            found=str(version),
        )
        if not force:
            return version, warnings, refusal
        warnings.append(f"{refusal.message}: {version} not in {patch.versions}; forced")
    return version, warnings, None


def _plan_edits(
    tree: VllmTree, edits: Iterable[Edit], direction: Direction, sources: dict
) -> Iterable[EditPlan]:
    """Each edit planned; ``sources`` collects every file read (relpath -> text)."""

    def read(rel: str) -> str:
        if rel not in sources:
            sources[rel] = tree.read_text(rel)
        return sources[rel]

    texts: dict[str, str] = {}  # files as edited so far, so edits to one file chain
    for edit in edits:
        codemod = edit.apply if direction == "apply" else edit.revert
        if edit.optional and not tree.exists(edit.file):
            yield EditPlan(
                edit,
                skipped=PatchError("not in this tree", path=tree.display(edit.file)),
            )
            continue
        path = edit.file
        try:
            path = follow(tree, edit.file)
            before = texts[path] if path in texts else read(path)
            after, described = _run_codemod(
                codemod, before, lambda rel: read(follow(tree, rel))
            )
        except PatchError as exc:
            if exc.path == edit.file:
                exc.path = tree.display(path)
            yield EditPlan(edit, **{"skipped" if edit.optional else "error": exc})
            continue
        texts[path] = after
        shim = path if path != edit.file else None
        yield EditPlan(edit, before, after, described=described, path=shim)


def _run_codemod(codemod, source, read_tree_file):
    from patcher.codemod import run_codemod_described  # LibCST: only when run

    return run_codemod_described(codemod, source, read_tree_file)


@dataclass(frozen=True)
class EditVerdict:
    file: str
    via: str | None
    status: PlanStatus
    reason: str | None = None


@dataclass(frozen=True)
class Verdict:
    """What ``check`` reports of a patch on a tree: a plan's statuses, without
    the texts."""

    patch: str
    version: Version | None
    status: PlanStatus
    error: str | None = None
    warnings: tuple[str, ...] = ()
    edits: tuple[EditVerdict, ...] = ()

    @classmethod
    def of(cls, p: PatchPlan) -> Verdict:
        edits = tuple(
            EditVerdict(e.file, e.via, e.status(p.direction), e.reason) for e in p.edits
        )
        error = str(p.error) if p.error else None
        return cls(p.patch.name, p.version, p.status, error, p.warnings, edits)


def check(tree: VllmTree, patch: Patch, *, force: bool = False) -> Verdict:
    """What :func:`plan` says of applying ``patch`` to ``tree``; from the
    patch's record of judged trees (``known``) when the tree is one of them,
    without running a codemod."""
    version, warnings, refusal = _version_check(tree, patch, force)
    edits = edits_for(tree, patch)
    shimmed = any(_followed(tree, e.file) != e.file for e in edits)
    word = (
        None
        if refusal or shimmed
        else known.judged(tree, patch.folder, [e.file for e in edits])
    )
    if word is None:
        return Verdict.of(plan(tree, patch, force=force))
    status = PlanStatus(word)
    return Verdict(
        patch.name,
        version,
        status,
        warnings=tuple(warnings),
        edits=tuple(EditVerdict(e.file, None, status) for e in edits),
    )


def _refuse_errors(p: PatchPlan) -> None:
    if p.errors:
        raise p.errors[0]


@dataclass(frozen=True)
class Outcome:
    patch: str
    action: str
    files: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    """What the engine found or did besides the patch itself: an interrupted
    operation finished or rolled back, a damaged backup, a plan made again. (What
    the plan warned about is the plan's: ``PatchPlan.warnings``.)"""

    def __str__(self) -> str:
        where = f" ({', '.join(self.files)})" if self.files else ""
        return f"{self.patch}: {self.action}{where}"


def _writable_tree(tree: VllmTree, verb: str) -> None:
    if tree.is_wheel:
        refuse_wheel(tree.location, verb)


def _bases(tree: VllmTree) -> tuple[Path, ...]:
    """Where a write may land: the tree, and a checkout's git directory."""
    root = real(tree.location)
    return (root, git_dir(root)) if tree.kind == "checkout" else (root,)


def _touched(tree: VllmTree, patch: Patch) -> frozenset[str]:
    """The tree paths ``patch`` may write: each edit's file and, where that is a
    compatibility shim, the file it leads to."""
    files = {e.file for e in patch.edits + patch.test_edits}
    return frozenset(files | {_followed(tree, rel) for rel in files})


def scope(tree: VllmTree, patches: Iterable[Patch]) -> Scope:
    """What writing ``patches`` to ``tree`` may touch: their files and backups,
    each resolved, and only where that lies inside the tree (a link out of it
    is refused when the plan reads it)."""
    bases = _bases(tree)
    out = Scope(bases)
    for patch in patches:
        backup = backup_of(tree, patch)
        rels = sorted(backup.files)
        files = [tree.path(r) for r in rels] + [backup.copy_path(r) for r in rels]
        files.append(backup.manifest_path)
        inside = frozenset(real(f) for f in files if is_inside(f, bases))
        out = out | Scope(bases, inside, frozenset([backup.folder]))
    return out


def _scope_of(tree: VllmTree):
    """The scope of the patch a record names ("apply of NAME"); a name that is
    no patch of this project gets an empty scope: every entry is foreign."""
    by_name = {p.name: p for p in all_patches()}

    def scope_of(operation: str) -> Scope:
        name = patch_of(operation)
        return scope(tree, [by_name[name]]) if name in by_name else Scope(())

    return scope_of


def _followed(tree: VllmTree, relpath: str) -> str:
    try:
        return follow(tree, relpath)
    except PatchError:  # reported by the plan
        return relpath


def recover(tree: VllmTree, patches: Iterable[Patch]) -> list[str]:
    """Finish or roll back an operation a kill interrupted (see ``atomic``), and
    delete what an interrupted write left; what was done, one line each."""
    if tree.is_wheel:
        return []
    patches = list(patches)
    where = scope(tree, patches)
    # A first look without the lock, so that a command with nothing to recover
    # never waits for a writer. The writer may be removing the backup folders
    # this looks into; then the look is made again under the lock.
    try:
        if not atomic.pending(tree.location, where):
            return []
    except OSError:  # a folder gone under the look: look again, locked
        pass
    with atomic.locked(tree.location):
        return atomic.recover(tree.location, where, _scope_of(tree))


@contextmanager
def reading(tree: VllmTree, patches: Iterable[Patch]) -> Iterator[list[str]]:
    """Hold a shared lock on ``tree`` with nothing left to recover, so what is
    read inside is never a write half done; yields what recovery did first."""
    patches = list(patches)
    notes: list[str] = []
    if tree.is_wheel:
        yield notes
        return
    while True:
        notes += recover(tree, patches)
        with atomic.locked(tree.location, shared=True):
            # A writer killed between the recovery and this lock left a record.
            if not _pending(tree, patches):
                yield notes
                return


def _pending(tree: VllmTree, patches: list[Patch]) -> bool:
    try:
        return atomic.pending(tree.location, scope(tree, patches))
    except OSError as exc:
        raise PatchError(
            f"cannot look for an interrupted write ({atomic.what_failed(exc)})",
            path=str(tree.location),
            looked_for="the intent record and the files a write leaves",
            found="nothing was read or changed; if a write was interrupted here, "
            "the next vllm-patch command on this tree finishes or rolls it back",
        ) from exc


def apply(
    tree: VllmTree,
    patch: Patch,
    *,
    force: bool = False,
    planned: PatchPlan | None = None,
) -> Outcome:
    """Apply ``patch`` to ``tree``. ``planned``: the caller's own plan of it (the
    CLI checks every patch before it writes any), written as it is unless the
    tree no longer holds what it was made from (another writer came between the
    plan and the lock); then, and without ``planned``, it is planned here."""
    _writable_tree(tree, "apply to")
    if planned is not None and (
        planned.patch.name != patch.name
        or planned.tree.location != tree.location
        or planned.direction != "apply"
    ):
        raise ValueError(f"{planned.patch.name}'s plan is not this apply's")
    with atomic.locked(tree.location):
        where = scope(tree, [patch])
        notes = atomic.recover(tree.location, where, _scope_of(tree))
        if planned is not None and _still_current(tree, planned):
            p = planned
        else:
            if planned is not None:
                notes.append(
                    f"{patch.name}: the tree changed after the check; planned again"
                )
            p = plan(tree, patch, "apply", force=force)
        _refuse_errors(p)
        changes = {
            rel: (a.encode(), b.encode()) for rel, (a, b) in p.file_changes().items()
        }
        if not changes:
            return Outcome(patch.name, "already applied", (), tuple(notes))
        writes = {tree.path(rel): after for rel, (_, after) in changes.items()}
        # A checkout is reverted by the inverse edit, unless that would not give
        # these bytes back (part of the change was there already, made by hand):
        # then it gets a backup too, kept in its git directory.
        if tree.kind == "installed" or not _inverse_restores(tree, p):
            backup = backup_of(tree, patch)
            state = backup.read()
            notes += [
                f"damaged backup, entry left out (its file is backed up anew or "
                f"reverted by the inverse edit): {problem}"
                for problem in state.problems
            ]
            writes |= backup.files_to_write(changes, state)
        atomic.write_atomically(
            tree.location, writes, where, label=f"apply of {patch.name}"
        )
    partly = any(not e.changes for e in p.edits if e.skipped is None)
    action = "completed" if partly else "applied"
    return Outcome(patch.name, action, _shown(p, changes), tuple(notes))


def _still_current(tree: VllmTree, p: PatchPlan) -> bool:
    """Whether ``tree`` still holds the version and every file text ``p`` read."""
    try:
        return read_version(tree) == p.version and all(
            tree.read_text(rel) == text for rel, text in p.sources.items()
        )
    except PatchError:  # a file gone or unreadable: the new plan says which
        return False


def backup_of(tree: VllmTree, patch: Patch) -> Backup:
    """Beside ``vllm/``; for a checkout in its git directory, out of the work tree.
    Refused (exit 3) when the store is a link or a ``.git`` file points elsewhere."""
    return Backup.of(_bases(tree)[-1], patch.name, _touched(tree, patch))


def _inverse_restores(tree: VllmTree, p: PatchPlan) -> bool:
    """Whether the patch's inverse edits alone turn every changed file back."""
    changes = p.file_changes()
    texts = {rel: after for rel, (_, after) in changes.items()}

    def read(rel: str) -> str:
        rel = follow(tree, rel)
        return texts[rel] if rel in texts else tree.read_text(rel)

    for e in reversed(p.edits):
        if e.file in texts and e.changes:
            try:
                texts[e.file] = _run_codemod(e.edit.revert, texts[e.file], read)[0]
            except PatchError:
                return False
    return all(texts[rel] == before for rel, (before, _) in changes.items())


def _shown(p: PatchPlan, changes) -> tuple[str, ...]:
    """The changed files, each with the shim that led to it."""
    via = {e.file: e.via for e in p.edits if e.via}
    return tuple(
        f"{rel} via the shim {via[rel]}" if rel in via else rel for rel in changes
    )


def revert(tree: VllmTree, patch: Patch) -> Outcome:
    _writable_tree(tree, "revert")
    with atomic.locked(tree.location):
        where = scope(tree, [patch])
        notes = atomic.recover(tree.location, where, _scope_of(tree))
        backup = backup_of(tree, patch)
        state = backup.read()
        notes += [
            f"damaged backup, reverting by the inverse edit instead: {problem}"
            for problem in state.problems
        ]
        restored = {}
        for edit in patch.edits:
            path = follow(tree, edit.file)
            current = tree.read_bytes(path)
            if backup.restorable(state, path, current):
                restored[path] = (current, backup.original(path))
        rest = [
            e for e in edits_for(tree, patch) if follow(tree, e.file) not in restored
        ]
        p = PatchPlan(
            patch,
            tree,
            "revert",
            read_version(tree),
            tuple(_plan_edits(tree, rest, "revert", {})),
        )
        if p.errors and state.problems:
            raise _unrevertable(p.errors[0], backup, state)
        _refuse_errors(p)
        changes = restored | {
            rel: (a.encode(), b.encode()) for rel, (a, b) in p.file_changes().items()
        }
        writes = {tree.path(rel): after for rel, (_, after) in changes.items()}
        if writes or backup.exists():
            atomic.write_atomically(
                tree.location,
                writes,
                where,
                remove=backup.removals(),
                label=f"revert of {patch.name}",
            )
    action = "reverted" if changes else "nothing to revert"
    return Outcome(patch.name, action, _shown(p, changes), notes=tuple(notes))


def _unrevertable(error: PatchError, backup: Backup, state: BackupState) -> PatchError:
    return PatchError(
        "cannot revert: the backup is damaged and the inverse edit does not "
        f"recognise the file ({error.message})",
        path=error.path,
        looked_for=error.looked_for,
        found=f"{error.found}; backup: {'; '.join(state.problems)}. Reinstall "
        f"vLLM to get the original file back, then delete {backup.folder}",
    )
