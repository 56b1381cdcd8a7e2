"""``vllm-patch pr``: the form of the change vLLM's main takes, committed on a
branch of a vLLM git checkout with a sign-off and an attribution trailer, and
the PR description outside the work tree. It never pushes.

Steps: :func:`preflight` checks everything that needs nothing written and
returns frozen :class:`Settings`; :func:`on_branch` switches the branch and
puts the checkout back on any exit but success (an error, Ctrl-C, SIGTERM,
SIGHUP: one line, exit 3); inside it the engine plans and writes once, the CI
wiring is added, vLLM's tests run (``--no-tests`` skips them), the figures are
measured (``--no-bench`` skips them), and the commit is made.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import git
from packaging.version import InvalidVersion, Version

from patcher import engine
from patcher.errors import ExitCode, PatchError, UsageError, warn
from patcher.files import output_dir, output_path, own_paths, replace_at, write_output
from patcher.patchset import Patch, defaults
from patcher.status import PlanStatus
from patcher.tree import VllmTree, open_tree
from patcher.version import read_version
from vllm_patch.upstream import ci_yaml, figures, pr_body, template, vllm_tests
from vllm_patch.upstream.ci_yaml import CiEdit
from vllm_patch.upstream.meta import Upstream, main_form, upstream_of
from vllm_patch.upstream.pr_format import check_changes

UPSTREAM_REPO = "vllm-project/vllm"
WIDTH = 72
"""Commit message lines: git's convention, which vLLM's history follows."""
SIGNALS = (signal.SIGTERM, signal.SIGHUP)
OPTIONS = [  # (flag, METAVAR (None: a switch), help)
    ("--vllm", "CHECKOUT", "a clean vLLM git checkout (required)"),
    ("--patch", "NAME", "the patch; only the form vLLM's main takes is sent"),
    ("--branch", "NAME", "branch to create or reuse; default: the patch's"),
    ("--base", "REF", "where to start (e.g. upstream/main); default: this branch"),
    ("--format-patch", "DIR", "also write the commit as an mbox (git am) into DIR"),
    ("--evidence", "DIR", "DIR/evidence.json's figures (bench --serve --out DIR)"),
    (
        "--out",
        "FILE",
        "the PR description; default: <git-dir>/vllm-patch/PR_<branch>.md",
    ),
    ("--no-tests", None, "do not run vLLM's tests (the checkout's code) of the edit"),
    ("--no-bench", None, "measure nothing (without --evidence: per call, accuracy)"),
    ("--pytest-k", "EXPR", "run only the upstream tests matching EXPR (pytest -k)"),
    ("--print", None, "also print the PR description"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, metavar, text in OPTIONS:
        kind = {"metavar": metavar} if metavar else {"action": "store_true"}
        if metavar in ("DIR", "FILE"):
            kind["type"] = Path
        parser.add_argument(flag, help=text, required=flag == "--vllm", **kind)


@dataclass(frozen=True)
class Identity:
    name: str
    email: str

    @property
    def signoff(self) -> str:
        return f"Signed-off-by: {self.name} <{self.email}>"


@dataclass(frozen=True)
class Settings:
    """One ``pr`` run, checked before anything is written."""

    repo: git.Repo
    root: Path
    tree: VllmTree
    patch: Patch
    upstream: Upstream
    branch: str
    identity: Identity
    description: Path
    own_description: bool
    """In the checkout's git directory (made there, no link on the way)."""
    mbox: Path | None
    evidence: dict | None
    start: str
    """The branch (or, detached, the commit) to come back to."""
    created: bool
    tip: str | None
    """The existing branch's commit (None: the branch is created)."""
    base: str | None
    args: argparse.Namespace


class Interrupted(BaseException):
    """SIGTERM or SIGHUP, raised where ``pr`` is, as Ctrl-C raises KeyboardInterrupt."""


def open_checkout(path: str | Path) -> git.Repo:
    try:
        repo = git.Repo(Path(path).expanduser(), search_parent_directories=False)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError) as exc:
        raise UsageError(
            "not a git checkout (pr needs a vLLM git clone; use apply for other trees)",
            path=str(path),
            looked_for=".git",
            found=type(exc).__name__,
        ) from exc
    if repo.bare or repo.working_tree_dir is None:
        raise UsageError("a bare repository has no work tree", path=str(path))
    return repo


def git_identity(repo: git.Repo) -> Identity:
    """The committer identity git would use, configured explicitly (no guessing
    from the host name: the sign-off must name a real person)."""
    try:
        ident = repo.git.execute(
            ["git", "-c", "user.useConfigOnly=true", "var", "GIT_COMMITTER_IDENT"]
        )
    except git.GitCommandError as exc:
        raise UsageError(
            "no git identity for the commit and its Signed-off-by line; run\n"
            '  git config --global user.name "Your Name"\n'
            '  git config --global user.email "you@example.com"',
            path=repo.working_tree_dir,
        ) from exc
    name, _, rest = ident.partition(" <")
    return Identity(name.strip(), rest.partition(">")[0].strip())


def refuse_dirty(repo: git.Repo) -> None:
    if repo.is_dirty(index=True, working_tree=True, untracked_files=False):
        changed = [d.a_path for d in repo.index.diff(None)]
        changed += [d.a_path for d in repo.index.diff("HEAD")]
        raise UsageError(
            "the work tree has uncommitted changes; commit or stash them first",
            path=repo.working_tree_dir,
            found=", ".join(sorted(set(changed))[:10]) or "staged changes",
        )


def resolve_base(repo: git.Repo, base: str | None) -> tuple[str, git.Commit]:
    where = repo.working_tree_dir
    if base is None and repo.head.is_detached:
        raise UsageError(
            "HEAD is detached; pass --base REF (e.g. upstream/main)", path=where
        )
    if base is None:
        return repo.active_branch.name, repo.head.commit
    try:
        return base, repo.commit(base)
    except (git.BadName, ValueError) as exc:
        raise UsageError(
            f"unknown base {base!r}",
            path=where,
            looked_for="a branch, tag or commit (git rev-parse)",
            found="nothing",
        ) from exc


def checkout_version(repo: git.Repo, tree: VllmTree) -> Version | None:
    """vllm/_version.py when the build wrote it, else the nearest v* tag."""
    version = read_version(tree)
    if version is not None:
        return version
    try:
        tag = repo.git.describe("--tags", "--abbrev=0", "--match", "v[0-9]*")
        return Version(tag.lstrip("v"))
    except (git.GitCommandError, InvalidVersion):
        return None


def _branch_name(repo: git.Repo, branch: str) -> str:
    try:
        named = repo.git.check_ref_format("--branch", branch)
    except git.GitCommandError:
        named = None
    if named != branch or branch.startswith("-"):  # @{-1} names another branch
        raise UsageError(f"not a valid branch name: {branch!r}")
    return branch


def preflight(args: argparse.Namespace) -> Settings:
    """Every check that needs nothing written; the settings they give."""
    repo = open_checkout(args.vllm)
    root = Path(repo.working_tree_dir)
    tree = open_tree(root)  # a vLLM checkout at all? (exit 3 otherwise)
    patch = main_form(args.patch)
    upstream = upstream_of(patch)
    branch = _branch_name(repo, args.branch or upstream.branch)
    identity = git_identity(repo)
    if not repo.head.is_valid():
        raise UsageError("the checkout has no commits", path=str(root))
    refuse_dirty(repo)
    git_dir = Path(repo.git_dir).resolve()
    own = args.out is None
    own_file = git_dir / "vllm-patch" / f"PR_{branch.replace('/', '_')}.md"
    out = Path(os.path.abspath(args.out or own_file))
    if own:
        output_path(root, out.parent, "the PR description", folder=True, but=git_dir)
    output_path(root, out, "the PR description", but=git_dir)
    if args.format_patch:
        output_path(root, args.format_patch, "--format-patch DIR", folder=True)
    head = repo.head
    created = branch not in repo.heads
    return Settings(
        repo=repo,
        root=root,
        tree=tree,
        patch=patch,
        upstream=upstream,
        branch=branch,
        identity=identity,
        description=out,
        own_description=own,
        mbox=args.format_patch,
        evidence=pr_body.load_evidence(args.evidence, patch),
        start=head.commit.hexsha if head.is_detached else repo.active_branch.name,
        created=created,
        tip=None if created else repo.heads[branch].commit.hexsha,
        base=args.base,
        args=args,
    )


@dataclass
class Switched:
    """What ``on_branch`` did, and what the steps inside it add."""

    base: str | None
    new_files: list[str] = field(default_factory=list)
    """Files the patch created (gone again on rollback)."""
    keep: bool = False
    """Set by the last step: the branch stays as it is."""


@contextlib.contextmanager
def on_branch(s: Settings) -> Iterator[Switched]:
    """On the branch (created from the base, or the existing one, which must
    contain the base); back where the checkout was on any exit without ``keep``."""
    done = Switched(s.base)
    try:
        if s.created:
            done.base, commit = resolve_base(s.repo, s.base)
            s.repo.git.checkout("-q", "-b", s.branch, commit.hexsha)
        elif s.base and not s.repo.is_ancestor(resolve_base(s.repo, s.base)[1], s.tip):
            raise UsageError(
                f"branch {s.branch} exists and does not contain {s.base}; pass "
                "--branch NEW or delete the branch",
                path=str(s.root),
            )
        elif s.start != s.branch:
            s.repo.git.checkout("-q", s.branch)
        yield done
    finally:
        if not done.keep:
            with _signals_held():
                _rollback(s, done)


def _rollback(s: Settings, done: Switched) -> None:
    """Back on the starting branch, nothing committed, no file left (git's
    hooks are not run: this undoes what ``pr`` did)."""
    repo = s.repo

    def git_(*args: str) -> None:
        repo.git.execute(["git", "-c", "core.hooksPath=/dev/null", *args])

    if s.tip and not repo.head.is_detached and repo.active_branch.name == s.branch:
        git_("reset", "-q", "--hard", s.tip)
    git_("checkout", "-q", "-f", s.start)
    if s.created and s.branch in repo.heads:
        git_("branch", "-D", s.branch)
    for rel in done.new_files:
        Path(s.root, rel).unlink(missing_ok=True)


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`Interrupted` while ``pr`` runs."""

    def interrupted(signum, _frame):
        raise Interrupted(signal.Signals(signum).name)

    old = {sig: signal.signal(sig, interrupted) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """No signal cuts the rollback short; one that came is delivered after."""
    held = {signal.SIGINT, *SIGNALS}
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


@dataclass
class Change:
    """The patch's change on the branch: its commit to be made, made, or found."""

    plan: engine.PatchPlan
    commit: git.Commit | None
    """None: not made yet, or the branch has the change but no commit titled
    like the patch."""
    described: dict[str, list[str]]
    ci: list[CiEdit] = field(default_factory=list)
    files: tuple[str, ...] = ()
    """What the commit to make holds."""


def run(args: argparse.Namespace) -> int:
    """The steps in order; an interruption is one line, exit 3."""
    try:
        with _signals_raise():
            return _steps(args)
    except (KeyboardInterrupt, Interrupted) as exc:
        name = exc.args[0] if exc.args else "Ctrl-C"
        raise PatchError(
            f"interrupted ({name}); the checkout is back where it was, nothing "
            "committed"
        ) from None
    except git.GitCommandError as exc:
        said = (exc.stderr or "").strip().removeprefix("stderr:").strip(" '\n")
        raise UsageError(
            "git refused a step (the checkout's git config or hooks, as git itself "
            "runs them); the checkout is back where it was",
            path=str(args.vllm),
            looked_for=f"git {' '.join(map(str, exc.command[1:3]))} to succeed",
            found=said.splitlines()[-1] if said else f"exit status {exc.status}",
        ) from exc


def _steps(args: argparse.Namespace) -> int:
    s = preflight(args)
    with on_branch(s) as switched:
        done = _apply(s, switched)
        if done is None:  # the base has the change already: no branch made
            return ExitCode.OK
        body = _description(s, switched, done)  # vLLM's tests run before the commit
        if done.commit is None and done.files:
            done.commit = _commit(s, switched, done)
        _write_outputs(s, done, body)
        switched.keep = True
    if args.print:
        print("\n" + body)
    _print_next_steps(s, switched)
    return ExitCode.OK


def _refuse_ir_era(s: Settings, version: Version | None) -> None:
    """Without ``--patch``, a release whose own form is another (the vLLM IR
    form, 0.20 - 0.32) is refused: ``pr`` sends the form vLLM's main takes."""
    if s.args.patch or version is None or s.patch in defaults(version):
        return
    theirs = ", ".join(p.name for p in defaults(version)) or "none"
    raise UsageError(
        f"this checkout is vLLM {version}, whose form of the change is {theirs}; "
        f"pr commits only the form vLLM's main takes: pass --patch {s.patch.name} "
        f"(it applies to vLLM {s.patch.versions})",
        path=str(s.root),
    )


def _apply(s: Settings, switched: Switched) -> Change | None:
    """Apply the patch (and the CI edits) to be committed, or find the branch's
    commit of it; None when a new branch would be empty (then it is deleted)."""
    _refuse_ir_era(s, checkout_version(s.repo, s.tree))
    plan = engine.plan(s.tree, s.patch)
    if plan.errors:
        raise plan.errors[0]
    for w in plan.warnings:
        warn(w)
    if plan.status is PlanStatus.APPLIED and s.created:
        print(
            f"{s.patch.name}: {switched.base} already contains this change; "
            "nothing to commit, no branch created"
        )
        return None
    if plan.status is PlanStatus.APPLIED:
        return _found_commit(s, plan)
    changes = plan.file_changes()
    own_paths(s.root, list(changes))
    switched.new_files = [r for r in changes if not os.path.lexists(s.root / r)]
    ci = [ci_yaml.wire(s.root, w) for w in s.upstream.ci]
    for edit in ci:
        if edit.text is None:
            warn(f"{edit.wiring.file} left as it is: {edit.reason}")
    engine.apply(plan.tree, plan)
    formatting = check_changes(s.root, changes)
    files = list(changes)
    for edit in ci:
        if edit.text is not None:
            replace_at(s.root.resolve() / edit.wiring.file, edit.text.encode())
            files.append(edit.wiring.file)
    print(f"formatted and checked the changed files with {formatting.ruff}")
    for note in formatting.notes:
        warn(note)
    return Change(plan, None, _with_ci(plan.described(), ci), ci, tuple(files))


def _with_ci(described: dict[str, list[str]], ci: list[CiEdit]) -> dict:
    """The codemods' changes, and each CI file's when it is edited (or, when it
    is left out, why)."""
    more = {
        e.wiring.file: e.described() if e.text else [e.reason]
        for e in ci
        if e.text or e.reason.startswith("left out")
    }
    return {**described, **more}


def commit_message(upstream: Upstream, identity: Identity, trailer: str) -> str:
    """Title, why (the patch's text), the attribution trailer and the sign-off;
    wrapped at 72 columns. The description says the rest."""
    title = upstream.title
    if len(title) > WIDTH:
        raise PatchError(
            f"the commit title is over {WIDTH} columns",
            looked_for="[upstream] title",
            found=title,
        )
    return f"{title}\n\n{_wrap(upstream.body)}\n\n{trailer}\n{identity.signoff}\n"


def _wrap(text: str) -> str:
    """Each paragraph of ``text`` filled to ``WIDTH``; paths and names are
    split only when one is longer than a line."""
    return "\n\n".join(
        textwrap.fill(" ".join(p.split()), WIDTH, break_on_hyphens=False)
        for p in text.strip().split("\n\n")
    )


def _commit(s: Settings, switched: Switched, done: Change) -> git.Commit:
    """Commit the applied patch with the trailer and a sign-off."""
    s.repo.git.add("--", *done.files)
    message = commit_message(s.upstream, s.identity, pr_body.attribution(s.root))
    s.repo.git.commit("--no-verify", "-q", "--cleanup=whitespace", "-m", message)
    commit = s.repo.head.commit
    print(
        f"{s.patch.name}: committed {commit.hexsha[:12]} on branch {s.branch} (from "
        f"{switched.base or 'the existing branch'}): {s.upstream.title}"
    )
    return commit


def _found_commit(s: Settings, plan: engine.PatchPlan) -> Change:
    """The existing branch's commit of the patch (found by its title): what it
    changes is the files it holds."""
    commits = s.repo.iter_commits(s.branch, max_count=200)
    commit = next((c for c in commits if c.summary == s.upstream.title), None)
    where = f"as {commit.hexsha[:12]} " if commit else ""
    switch = " (switched to it)" if s.start != s.branch else ""
    print(
        f"{s.patch.name}: already committed {where}on branch {s.branch}{switch}; "
        "nothing changed"
    )
    files = sorted(commit.stats.files) if commit else []
    return Change(plan, commit, {f: [] for f in files})


def _tests(s: Settings, plan: engine.PatchPlan) -> vllm_tests.TestRuns | None:
    """vLLM's tests of the edited test files, run now unless ``--no-tests`` or
    this machine has no matching vLLM: the user is told first that they are
    the checkout's code."""
    edited = [e.edit.file for e in plan.edits if e.edit.optional and not e.skipped]
    if not edited:
        return None
    keyword = s.args.pytest_k
    depends = _depends(s)
    no_tests = s.args.no_tests
    why_not = no_tests or vllm_tests.unavailable(s.root, edited, s.patch, depends)
    if why_not:
        command = vllm_tests.reviewer_command(edited, keyword)
        said = "skipped (--no-tests)" if no_tests else f"cannot run here ({why_not})"
        print(
            f"upstream tests: {said}; the PR description gives the reviewer's command"
        )
        return vllm_tests.TestRuns(vllm_tests.TestRun(command, ran=False, reason=said))
    runs = vllm_tests.measure(s.root, edited, s.patch, depends, keyword)
    after, before = runs.after, runs.before
    fails = f"; without the change: {before.summary()}" if before and before.ran else ""
    print(f"upstream tests: {after.summary() + fails if after.ran else after.reason}")
    return runs


def _description(s: Settings, switched: Switched, done: Change) -> str:
    """The PR description's text, with the upstream tests and the figures
    measured now."""
    read = template.read_template(s.root)
    if read.left_out:
        warn(f"PR template {read.left_out}; the fallback layout is used")
    facts = pr_body.Facts(
        evidence=s.evidence,
        described=done.described,
        tests=_tests(s, done.plan),
        left_out={e.edit.file: e.skipped.message for e in done.plan.skipped},
        ci=done.ci,
        measured=None if s.evidence or s.args.no_bench else _measure(s, done.plan),
    )
    return pr_body.render(s.patch, s.upstream, facts, read)


def _measure(s: Settings, plan: engine.PatchPlan) -> figures.Measured:
    """The per-call and eager Qwen3 figures, said first (they take minutes)."""
    print("figures: per call and eager Qwen3, base and this change (--no-bench skips)")
    tests = [e.edit.file for e in plan.edits if e.edit.optional]
    measured = figures.measure(s.root, s.patch, tests, _depends(s), print)
    if measured.why_not:
        print(f"figures: cannot measure here ({measured.why_not})")
    return measured


def _depends(s: Settings) -> list[str]:
    deps = tuple(d for w in s.upstream.ci for d in w.dependencies)
    return vllm_tests.depends_on(s.patch, deps)


def _write_outputs(s: Settings, done: Change, body: str) -> None:
    """The description, and with --format-patch the commit as an mbox patch for
    ``git am``: never through a link or special file found where they go."""
    if s.own_description:  # in the resolved git directory: no link on the way
        output_dir(s.description.parent)
        replace_at(s.description, body.encode())
    else:
        write_output(s.description, body)
    print(f"PR description: {s.description}")
    if not s.mbox:
        return
    if done.commit is None:
        warn("no commit titled like the patch on the branch; no mbox written")
        return
    folder = output_dir(s.mbox)
    with tempfile.TemporaryDirectory(prefix="vllm-patch-mbox-") as tmp:
        made = Path(s.repo.git.format_patch("-1", done.commit.hexsha, "-o", tmp))
        written = write_output(folder / made.name, made.read_bytes())
    # Plain `git am` strips every leading [...] from the subject, the
    # [CPU][Kernel] tags included; -b (--keep-non-patch) keeps them.
    print(f"mbox patch: {written}")
    print(f"  apply with: git am --keep-non-patch {shlex.quote(str(written))}")


def _print_next_steps(s: Settings, switched: Switched) -> None:
    """The push and ``gh pr create`` commands; nothing is pushed."""
    base = switched.base or ""
    remote = next((r for r in s.repo.remotes if base.startswith(f"{r.name}/")), None)
    pr_base = base.split("/", 1)[1] if remote else base or "main"
    pr_base = pr_base if remote or base in s.repo.heads else "main"
    title = shlex.quote(s.upstream.title)
    print(
        "\nNothing was pushed. To open the pull request:\n"
        f"  git -C {shlex.quote(str(s.root))} push -u <your-fork-remote> {s.branch}\n"
        f"  gh pr create --repo {UPSTREAM_REPO} --base {pr_base} "
        f"--head <your-github-user>:{s.branch} --title {title} "
        f"--body-file {shlex.quote(str(s.description))}"
    )
