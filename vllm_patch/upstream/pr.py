"""``vllm-patch pr``: the change committed, signed off, on a branch of a vLLM
checkout, with its PR description; never pushed. :func:`on_branch` rolls back."""

import argparse
import contextlib
import os
import shlex
import signal
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import git
from packaging.version import InvalidVersion, Version

from patcher import engine
from patcher.errors import ExitCode, Interrupted, PatchError, UsageError, warn
from patcher.files import (
    MAX_FILE_BYTES,
    output_dir,
    output_path,
    own_paths,
    replace_at,
    write_output,
)
from patcher.patchset import Patch, defaults
from patcher.status import PlanStatus
from patcher.tree import VllmTree, open_tree
from patcher.version import read_version
from vllm_patch.bench.record import Evidence
from vllm_patch.runtime import child
from vllm_patch.upstream import ci_yaml, figures, pr_body, template, vllm_tests
from vllm_patch.upstream.ci_yaml import CiEdit
from vllm_patch.upstream.meta import Upstream, main_form, upstream_of
from vllm_patch.upstream.pr_format import check_changes

WIDTH = 72  # commit message lines: git's convention, which vLLM's history follows
SIGNALS = (signal.SIGTERM, signal.SIGHUP)
REGULAR = (0o100644, 0o100755)  # git's modes of a regular file
OPTIONS = [  # (flag, METAVAR (None: a switch), help)
    ("--vllm", "CHECKOUT", "a clean vLLM git checkout (required)"),
    ("--patch", "NAME", "the patch; only the form vLLM's main takes is sent"),
    ("--branch", "NAME", "branch to create or reuse; default: the patch's"),
    ("--base", "REF", "where to start (e.g. upstream/main); default: this branch"),
    ("--format-patch", "DIR", "also write the commit as an mbox (git am) into DIR"),
    ("--evidence", "DIR", "DIR/evidence.json's figures (bench --serve --out DIR)"),
    ("--out", "FILE", "the PR description; default: in <git-dir>/vllm-patch/"),
    (
        "--no-tests",
        None,
        "do not run vLLM's tests (the checkout's code) of the edit",
    ),
    (
        "--no-bench",
        None,
        "measure nothing (without --evidence: per call, accuracy)",
    ),
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
class Settings:  # one run's, checked before anything is written
    repo: git.Repo
    tree: VllmTree
    patch: Patch
    branch: str
    signoff: str
    description: Path
    evidence: Evidence | None
    start: str  # the branch (or, detached, the commit) to come back to
    tip: str | None  # the existing branch's commit (None: the branch is created)
    base: str | None  # where the branch starts, or which it must contain
    base_commit: str | None
    args: argparse.Namespace

    @property
    def root(self) -> Path:
        return Path(self.repo.working_tree_dir)

    @cached_property
    def upstream(self) -> Upstream:
        return upstream_of(self.patch)


def open_checkout(path: Path) -> tuple[git.Repo, str]:
    """A clean checkout with commits; its committer's Signed-off-by,
    never guessed."""
    try:
        repo = git.Repo(Path(path).expanduser(), search_parent_directories=False)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError) as exc:
        raise UsageError(
            "not a git checkout (pr needs a vLLM git clone; use apply for other "
            "trees)",
            path=str(path),
            looked_for=".git",
            found=type(exc).__name__,
        ) from exc
    if repo.bare or repo.working_tree_dir is None:
        raise UsageError("a bare repository has no work tree", path=str(path))
    if not repo.head.is_valid():
        raise UsageError("the checkout has no commits", path=str(path))
    if repo.is_dirty():  # the index and tracked files
        changed = repo.git.diff("HEAD", "--name-only").split("\n")[:10]
        raise UsageError(
            "the work tree has uncommitted changes; commit or stash them first",
            path=repo.working_tree_dir,
            found=", ".join(filter(None, changed)) or "staged changes",
        )
    try:
        ident = repo.git(c="user.useConfigOnly=true").var("GIT_COMMITTER_IDENT")
    except git.GitCommandError as exc:
        raise UsageError(
            "no git identity for the commit and its Signed-off-by line; run\n"
            '  git config --global user.name "Your Name"\n'
            '  git config --global user.email "you@example.com"',
            path=repo.working_tree_dir,
        ) from exc
    name, _, rest = ident.partition(" <")
    return repo, f"Signed-off-by: {name.strip()} <{rest.partition('>')[0].strip()}>"


def refuse_ir_era(repo: git.Repo, tree: VllmTree, patch: Patch) -> None:
    """Refuse a release whose form is another (its version: the build's, or v*
    tag)."""
    version = read_version(tree)
    if version is None:
        with contextlib.suppress(git.GitCommandError, InvalidVersion):
            tag = repo.git.describe("--tags", "--abbrev=0", "--match", "v[0-9]*")
            version = Version(tag.lstrip("v"))
    if version is None or patch in defaults(version):
        return
    theirs = ", ".join(p.name for p in defaults(version)) or "none"
    raise UsageError(
        f"this checkout is vLLM {version}, whose form of the change is {theirs}; "
        f"pr commits only the form vLLM's main takes: pass --patch {patch.name} "
        f"(it applies to vLLM {patch.versions})",
        path=repo.working_tree_dir,
    )


def preflight(args: argparse.Namespace) -> Settings:
    """Every check that needs nothing written; the settings they give."""
    repo, signoff = open_checkout(args.vllm)
    root = Path(repo.working_tree_dir)
    tree = open_tree(root)  # a vLLM checkout at all? (exit 3 otherwise)
    patch = main_form(args.patch)
    if not args.patch:
        refuse_ir_era(repo, tree, patch)
    upstream = upstream_of(patch)
    branch = args.branch or upstream.branch
    named = None
    with contextlib.suppress(git.GitCommandError):
        named = repo.git.check_ref_format("--branch", branch)
    if named != branch or branch.startswith("-"):  # @{-1} names another branch
        raise UsageError(f"not a valid branch name: {branch!r}")
    git_dir = Path(repo.git_dir).resolve()  # outputs: outside the work tree but it
    own = git_dir / "vllm-patch" / f"PR_{branch.replace('/', '_')}.md"
    out = Path(os.path.abspath(args.out or own))
    if args.out is None:
        output_path(
            root, out.parent, "the PR description", folder=True, but=git_dir
        )
    output_path(root, out, "the PR description", but=git_dir)
    if args.format_patch:
        output_path(root, args.format_patch, "--format-patch DIR", folder=True)
    tip = repo.heads[branch].commit.hexsha if branch in repo.heads else None
    if args.base is None and tip is None and repo.head.is_detached:
        raise UsageError(
            "HEAD is detached; pass --base REF (e.g. upstream/main)", path=str(root)
        )
    base = args.base or (None if tip else repo.active_branch.name)
    try:
        base_commit = base and repo.commit(base).hexsha
    except (git.BadName, ValueError) as exc:
        raise UsageError(
            f"unknown base {base!r}",
            path=str(root),
            looked_for="a branch, tag or commit (git rev-parse)",
            found="nothing",
        ) from exc
    evidence = pr_body.load_evidence(args.evidence, patch)
    head = repo.head
    start = head.commit.hexsha if head.is_detached else repo.active_branch.name
    return Settings(
        repo,
        tree,
        patch,
        branch,
        signoff,
        out,
        evidence,
        start,
        tip,
        base,
        base_commit,
        args,
    )


@dataclass
class Work:  # what the steps on the branch found and made
    new_files: list[str] = field(default_factory=list)  # gone again on rollback
    keep: bool = False  # set by the last step: the branch stays as it is
    plan: engine.PatchPlan | None = None
    described: dict[str, list[str]] = field(default_factory=dict)
    ci: list[CiEdit] = field(default_factory=list)
    files: tuple[str, ...] = ()  # what the commit to make holds
    commit: git.Commit | None = None  # made, or found on the branch by its title


@contextlib.contextmanager
def on_branch(s: Settings) -> Iterator[Work]:
    """On the branch; back as it was unless ``keep`` (hooks off, signals held)."""
    work = Work()
    try:
        if s.tip is None:
            s.repo.git.checkout("-q", "-b", s.branch, s.base_commit)
        elif s.base and not s.repo.is_ancestor(s.base_commit, s.tip):
            raise UsageError(
                f"branch {s.branch} exists and does not contain {s.base}; pass "
                "--branch NEW or delete the branch",
                path=str(s.root),
            )
        elif s.start != s.branch:
            s.repo.git.checkout("-q", s.branch)
        yield work
    finally:
        if not work.keep:
            held = {signal.SIGINT, *SIGNALS}
            signal.pthread_sigmask(signal.SIG_BLOCK, held)
            try:
                head = s.repo.head
                hooks = {"c": "core.hooksPath=/dev/null"}  # no hook
                if s.tip and not head.is_detached and head.ref.name == s.branch:
                    s.repo.git(**hooks).reset("-q", "--hard", s.tip)
                s.repo.git(**hooks).checkout("-q", "-f", s.start)
                if s.tip is None and s.branch in s.repo.heads:
                    s.repo.git(**hooks).branch("-D", s.branch)
                for rel in work.new_files:
                    Path(s.root, rel).unlink(missing_ok=True)
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


def run(args: argparse.Namespace) -> int:
    """The steps; SIGTERM, SIGHUP and Ctrl-C: one line, exit 130."""

    def interrupted(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    old = {sig: signal.signal(sig, interrupted) for sig in SIGNALS}
    try:
        return _steps(args)
    except KeyboardInterrupt as exc:
        name = exc.args[0] if exc.args else "Ctrl-C"
        raise Interrupted(
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
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _steps(args: argparse.Namespace) -> int:
    s = preflight(args)
    with on_branch(s) as work:
        if not _apply(s, work):  # the base has the change already: no branch made
            return ExitCode.OK
        body = _description(s, work)  # vLLM's tests run before the commit
        if work.commit is None and work.files:
            s.repo.git.add("--", *work.files)
            message = commit_message(
                s.upstream, s.signoff, pr_body.attribution(s.root)
            )
            s.repo.git.commit("--no-verify", "--cleanup=whitespace", "-qm", message)
            work.commit = s.repo.head.commit
            print(
                f"{s.patch.name}: committed {work.commit.hexsha[:12]} on branch "
                f"{s.branch} (from {s.base or 'the existing branch'}): "
                f"{s.upstream.title}"
            )
        if args.out is None:  # .git/vllm-patch made, never through a link
            output_dir(s.description.parent)
        print(f"PR description: {write_output(s.description, body)}")
        if args.format_patch and work.commit is None:
            warn("no commit titled like the patch on the branch; no mbox written")
        elif args.format_patch:
            with tempfile.TemporaryDirectory(prefix="vllm-patch-mbox-") as tmp:
                made = Path(s.repo.git.format_patch("-1", work.commit, "-o", tmp))
                mbox = output_dir(args.format_patch) / made.name
                write_output(mbox, made.read_bytes())
            # plain `git am` strips the subject's [CPU][Kernel] tags; -b keeps them
            print(f"mbox patch: {mbox}")
            print(f"  apply with: git am --keep-non-patch {shlex.quote(str(mbox))}")
        work.keep = True
    if args.print:
        print("\n" + body)
    base = s.base or ""  # nothing is pushed: the commands that would
    remote = any(base.startswith(f"{r.name}/") for r in s.repo.remotes)
    pr_base = "main"
    if remote:
        pr_base = base.split("/", 1)[1]
    elif base in s.repo.heads:
        pr_base = base
    checkout = shlex.quote(str(s.root))
    title = shlex.quote(s.upstream.title)
    body_file = shlex.quote(str(s.description))
    print(
        "\nNothing was pushed. To open the pull request:\n"
        f"  git -C {checkout} push -u <your-fork-remote> {s.branch}\n"
        f"  gh pr create --repo vllm-project/vllm --base {pr_base} "
        f"--head <your-github-user>:{s.branch} --title {title} "
        f"--body-file {body_file}"
    )
    return ExitCode.OK


def _apply(s: Settings, work: Work) -> bool:
    """The patch and CI edits applied, or the branch's commit found; False: none."""
    work.plan = plan = engine.plan(s.tree, s.patch)
    if plan.errors:
        raise plan.errors[0]
    for w in plan.warnings:
        warn(w)
    if plan.status is PlanStatus.APPLIED and s.tip is None:
        print(
            f"{s.patch.name}: {s.base} already contains this change; "
            "nothing to commit, no branch created"
        )
        return False
    if plan.status is PlanStatus.APPLIED:  # the branch's commit, by its title
        commits = s.repo.iter_commits(s.branch, max_count=200)
        work.commit = next(
            (c for c in commits if c.summary == s.upstream.title), None
        )
        files = sorted(work.commit.stats.files) if work.commit else []
        work.described = {f: [] for f in files}
        if work.commit and work.commit.parents:  # the description kept whole
            work.described, work.ci = _replanned(s, work.commit, files)
        where = f"as {work.commit.hexsha[:12]} " if work.commit else ""
        switch = " (switched to it)" if s.start != s.branch else ""
        print(
            f"{s.patch.name}: already committed {where}on branch "
            f"{s.branch}{switch}; nothing changed"
        )
        return True
    changes = plan.file_changes()
    own_paths(s.root, list(changes))
    work.new_files = [r for r in changes if not os.path.lexists(s.root / r)]
    engine.apply(plan.tree, plan)
    ruff, notes = check_changes(s.root, changes)
    print(f"formatted and checked the changed files with {ruff}")
    for note in notes:
        warn(note)
    work.ci = [ci_yaml.wire(s.root, w) for w in s.upstream.ci]
    for edit in work.ci:
        if edit.text is None:
            warn(f"{edit.wiring.file} left as it is: {edit.reason}")
        else:
            replace_at(s.root.resolve() / edit.wiring.file, edit.text.encode())
    work.files = (*changes, *(e.wiring.file for e in work.ci if e.text))
    work.described = {
        **plan.described(),
        **_ci_described(work.ci),
        **_new_tests(changes),
    }
    return True


def _replanned(
    s: Settings, commit: git.Commit, files: list[str]
) -> tuple[dict[str, list[str]], list[CiEdit]]:
    """What ``commit`` did, planned again on its parent's copies of the patch's
    and the CI's files (regular blobs within ``MAX_FILE_BYTES``; a link is left
    out): a re-run's description names every change the first run's did."""
    wanted = s.patch.files | {w.file for w in s.upstream.ci}
    parent = commit.parents[0].tree
    with tempfile.TemporaryDirectory(prefix="vllm-patch-parent-") as tmp:
        # The test edits are planned only in a tree with tests/, as run 1 did.
        if any(t.path == "tests" and t.type == "tree" for t in parent.trees):
            Path(tmp, "tests").mkdir()
        for rel in sorted(wanted):
            try:
                blob = parent / rel
            except KeyError:
                continue
            if (
                blob.type == "blob"
                and blob.mode in REGULAR
                and blob.size <= MAX_FILE_BYTES
            ):
                dest = Path(tmp, rel)
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(blob.data_stream.read())
        plan = engine.plan(VllmTree(Path(tmp)), s.patch)
        ci = [ci_yaml.wire(Path(tmp), w) for w in s.upstream.ci]
    described = {  # run 1's order
        **plan.described(),
        **_new_tests(plan.file_changes()),
        **_ci_described(ci),
    }
    for rel in files:
        described.setdefault(rel, [])
    return {rel: said for rel, said in described.items() if rel in files}, ci


def _ci_described(ci: list[CiEdit]) -> dict[str, list[str]]:
    """Each CI file's change, or why it is left as it is."""
    return {e.wiring.file: e.described() for e in ci if e.text or e.left_out}


def _new_tests(changes: dict[str, tuple[str | None, str | None]]) -> dict:
    """Each file the change creates under ``tests/``: what it tests."""
    return {
        rel: [pr_body.tests_said(after)]
        for rel, (before, after) in changes.items()
        if rel.startswith("tests/") and before is None and after
    }


def commit_message(upstream: Upstream, signoff: str, trailer: str) -> str:
    """Title, why (each paragraph filled to ``WIDTH``), trailer and sign-off."""
    if len(upstream.title) > WIDTH:
        raise PatchError(
            f"the commit title is over {WIDTH} columns",
            looked_for="[upstream] title",
            found=upstream.title,
        )
    why = "\n\n".join(
        textwrap.fill(" ".join(p.split()), WIDTH, break_on_hyphens=False)
        for p in upstream.body.strip().split("\n\n")
    )
    return f"{upstream.title}\n\n{why}\n\n{trailer}\n{signoff}\n"


def _description(s: Settings, work: Work) -> str:
    """The PR description, with vLLM's tests run and the figures measured now, on
    two copies of the installed vLLM built once; with ``--no-tests`` no file of
    the checkout is put in them, so no code of the checkout runs."""
    read = template.read_template(s.root)
    if read.left_out:
        warn(f"PR template {read.left_out}; the fallback layout is used")
    optional = [e for e in work.plan.edits if e.edit.optional]
    # The run depends on the patch's files and the CI step's vllm/ ones.
    ci = {d for w in s.upstream.ci for d in w.dependencies if d.startswith("vllm/")}
    depends = sorted(ci | {e.file for e in s.patch.edits})
    tests = [e.edit.file for e in optional if not e.skipped]
    bench = not (s.evidence or s.args.no_bench)
    own = None if s.args.no_tests else s.root  # whose files go into the copies
    why = ""
    with contextlib.ExitStack() as stack:
        copies = None
        if bench or (tests and not s.args.no_tests):
            try:
                copies = stack.enter_context(
                    vllm_tests.sides(own, s.patch, depends)
                )
            except vllm_tests.Unavailable as exc:
                why = str(exc)
        started = figures.start_biases(copies) if bench and copies else []
        for pending in started:  # ended on any way out; finished ones: no-op
            stack.callback(child.stop, pending)
        runs = None
        if tests:
            skipped = "skipped (--no-tests)" if s.args.no_tests else why
            runs = vllm_tests.run_tests(
                copies, s.root, tests, s.args.pytest_k, skipped
            )
        measured = None
        if bench and copies is None:
            print(f"figures: cannot measure here ({why})")
            measured = figures.Measured(why_not=why)
        elif bench:
            print(
                "figures: per call, the bfloat16 bias, a real model and eager "
                "Qwen3, base and patched (--no-bench skips them)"
            )
            if own is None:
                print(
                    "figures: measured with the change as vllm-patch writes it "
                    "into the installed vLLM's own files; not measured: this "
                    "branch's own files (--no-tests runs no code of the checkout)"
                )
            measured = figures.measure(copies, s.patch, print, started)
    facts = pr_body.Facts(
        evidence=s.evidence,
        described=work.described,
        tests=runs,
        left_out={e.edit.file: e.skipped.message for e in work.plan.skipped},
        ci=work.ci,
        measured=measured,
    )
    print("The checklist, no box ticked (each is yours to tick or not):")
    for line in pr_body.checklist(facts, read):
        print(line)
    return pr_body.render(s.patch, s.upstream, facts, read)
