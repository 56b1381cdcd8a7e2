"""``vllm-patch pr``: turn a carried patch into a commit on a branch of a vLLM
git checkout, ready for an upstream pull request.

It creates (or reuses) a branch, applies the patch with the engine (one plan,
one write), checks the changed lines against the checkout's ruff settings,
wires the patch's tests into the CI YAML, runs vLLM's tests of the edited
files (the checkout's code: said first, ``--no-tests`` skips them), commits
with a vLLM-style title and a DCO ``Signed-off-by:``, and writes the PR
description outside the work tree (default ``<git-dir>/vllm-patch/PR_<branch>.md``).
It never pushes and never calls a web API: it prints the commands that would.

All or nothing: every refusal that needs nothing written comes first; any
failure after the branch was switched (a git step refused by the checkout's
config or hooks included) puts the checkout back on its starting branch with
nothing committed, and is one message with an exit code of ``ExitCode``: 2
usage (not a git checkout, dirty tree, detached HEAD without --base, unknown
base, no git identity, an output inside the work tree or planted as a link,
git refusing a step), 3 the patch cannot be applied to the base.
"""

from __future__ import annotations

import argparse
import os
import shlex
import stat
import tarfile
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import git
from packaging.version import InvalidVersion, Version

from patcher import engine
from patcher.errors import ExitCode, PatchError, UsageError, warn
from patcher.files import MAX_FILE_BYTES, kind, output_dir, replace_at, write_output
from patcher.patchset import Patch
from patcher.status import PlanStatus
from patcher.tree import open_tree
from patcher.version import read_version
from vllm_patch.upstream import ci_yaml, pr_body, template, vllm_tests
from vllm_patch.upstream.ci_yaml import CiEdit
from vllm_patch.upstream.meta import Upstream, pick_patch, upstream_of
from vllm_patch.upstream.pr_format import FormatReport, check_changes

UPSTREAM_REPO = "vllm-project/vllm"
WIDTH = 72
"""Commit message lines: git's convention, which vLLM's history follows."""
SAFE = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    arg = parser.add_argument
    arg("--vllm", metavar="CHECKOUT", required=True, help="a clean vLLM git checkout")
    arg("--patch", metavar="NAME", help="the patch; default: the only one")
    arg(
        "--branch",
        metavar="NAME",
        help="branch to create or reuse; default: the patch's",
    )
    arg(
        "--base",
        metavar="REF",
        help="branch, tag or commit to start from (e.g. upstream/main); default: the "
        "current branch",
    )
    arg(
        "--format-patch",
        metavar="DIR",
        type=Path,
        help="also write the commit as an mbox patch (git am) into DIR",
    )
    arg(
        "--evidence",
        metavar="DIR",
        type=Path,
        action="append",
        help="read compat cells and bench JSON from DIR (repeatable); default: the "
        "project's compat_matrix/results and vllm_patch/bench/reference",
    )
    arg(
        "--out",
        metavar="FILE",
        type=Path,
        help="where to write the PR description (outside the work tree); default: "
        "<git-dir>/vllm-patch/PR_<branch>.md",
    )
    arg(
        "--no-tests",
        action="store_true",
        help="do not run vLLM's tests of the edited files (they are the checkout's "
        "code); the description gives the command a reviewer runs",
    )
    arg(
        "--pytest-k",
        metavar="EXPR",
        help="run only the upstream tests matching EXPR (pytest -k); default: every "
        "test of the edited files",
    )
    arg(
        "--print",
        action="store_true",
        dest="print_body",
        help="also print the PR description on stdout",
    )


@dataclass(frozen=True)
class Identity:
    name: str
    email: str

    @property
    def signoff(self) -> str:
        return f"Signed-off-by: {self.name} <{self.email}>"


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
        changed += (
            [d.a_path for d in repo.index.diff("HEAD")] if repo.head.is_valid() else []
        )
        raise UsageError(
            "the work tree has uncommitted changes; commit or stash them first",
            path=repo.working_tree_dir,
            found=", ".join(sorted(set(changed))[:10]) or "staged changes",
        )


def resolve_base(repo: git.Repo, base: str | None) -> tuple[str, git.Commit]:
    if base is None:
        if repo.head.is_detached:
            raise UsageError(
                "HEAD is detached; pass --base REF (e.g. upstream/main)",
                path=repo.working_tree_dir,
            )
        if not repo.head.is_valid():
            raise UsageError("the checkout has no commits", path=repo.working_tree_dir)
        return repo.active_branch.name, repo.head.commit
    try:
        return base, repo.commit(base)
    except (git.BadName, ValueError) as exc:
        raise UsageError(
            f"unknown base {base!r}",
            path=repo.working_tree_dir,
            looked_for="a branch, tag or commit (git rev-parse)",
            found="nothing",
        ) from exc


def checkout_version(repo: git.Repo, root: Path) -> Version | None:
    """vllm/_version.py when the build wrote it, else the nearest v* tag."""
    version = read_version(open_tree(root))
    if version is not None:
        return version
    try:
        tag = repo.git.describe("--tags", "--abbrev=0", "--match", "v[0-9]*")
        return Version(tag.lstrip("v"))
    except (git.GitCommandError, InvalidVersion):
        return None


def commit_message(
    upstream: Upstream, identity: Identity, described: dict[str, list[str]]
) -> str:
    """Title, why (the patch's text), the rule, what this diff does (from the
    edit the codemods made), sign-off; wrapped at 72 columns."""
    if len(upstream.title) > WIDTH:
        raise PatchError(
            f"the commit title is over {WIDTH} columns",
            looked_for="[upstream] title",
            found=upstream.title,
        )
    parts = [_wrap(upstream.body)] + ([_wrap(upstream.rule)] if upstream.rule else [])
    parts.append("\n".join(_wrap(item, "  ") for item in changes_list(described)))
    body = "\n\n".join(parts)
    return f"{upstream.title}\n\n{body}\n\n{identity.signoff}\n"


def _wrap(text: str, indent: str = "") -> str:
    """Each paragraph of ``text`` filled to ``WIDTH``; paths and names are
    split only when one is longer than a line."""
    return "\n\n".join(
        textwrap.fill(
            " ".join(paragraph.split()),
            WIDTH,
            subsequent_indent=indent,
            break_on_hyphens=False,
        )
        for paragraph in text.strip().split("\n\n")
    )


def changes_list(described: dict[str, list[str]]) -> list[str]:
    """``- file: change`` per change the codemods recorded."""
    return [f"- {rel}: {c}" for rel, changes in described.items() for c in changes]


def _with_ci(
    described: dict[str, list[str]], ci: CiEdit | None
) -> dict[str, list[str]]:
    """The codemods' changes, and the CI file's when it is edited (or, when it
    is left out, why)."""
    if ci is None or not (ci.text or ci.reason.startswith("left out")):
        return described
    return {**described, ci.wiring.file: ci.described() if ci.text else [ci.reason]}


def described_in_commit(
    repo: git.Repo, commit: git.Commit, patch: Patch, upstream: Upstream
) -> tuple[dict[str, list[str]], CiEdit | None]:
    """What the patch changes in ``commit``'s parent, as the codemods describe it,
    and the CI edit made there (for a branch that already carries the commit).
    Only the parent's regular files are written out (a link, a special or an
    oversized file is left out, never followed)."""
    parent = f"{commit.hexsha}^"
    wanted = [e.file for e in patch.test_edits] + (
        [upstream.ci.file] if upstream.ci else []
    )
    present = [f for f in wanted if repo.git.ls_tree("--name-only", parent, "--", f)]
    with tempfile.TemporaryDirectory(prefix="vllm-patch-parent-") as tmp:
        proc = repo.git.archive(
            "--format=tar", parent, "vllm", *present, as_process=True
        )
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for member in tar:
                if member.isreg() and member.size <= MAX_FILE_BYTES:
                    tar.extract(member, tmp, **SAFE)
        proc.wait()
        ci = ci_yaml.wire(Path(tmp), upstream.ci) if upstream.ci else None
        return _with_ci(engine.plan(open_tree(tmp), patch).described(), ci), ci


def find_commit(repo: git.Repo, branch: str, title: str) -> git.Commit | None:
    return next(
        (c for c in repo.iter_commits(branch, max_count=200) if c.summary == title),
        None,
    )


def _refuse_planted(path: Path, want_dir: bool = False) -> None:
    """An output name where a link or special file (or, for a folder, anything
    but a folder) was planted is refused before anything is done."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not (stat.S_ISDIR(mode) if want_dir else stat.S_ISREG(mode)):
        raise UsageError(
            "vllm-patch never writes through a link or special file it finds",
            path=str(path),
            looked_for="a folder" if want_dir else "a regular file or no file",
            found=kind(mode),
        )


def description_path(repo: git.Repo, branch: str, out: Path | None) -> Path:
    root = Path(repo.working_tree_dir).resolve()
    git_dir = Path(repo.git_dir).resolve()
    own = git_dir / "vllm-patch"
    path = (
        Path(os.path.abspath(out)) if out else own / f"PR_{branch.replace('/', '_')}.md"
    )
    real = path.parent.resolve() / path.name
    if real.is_relative_to(root) and not real.is_relative_to(git_dir):
        raise UsageError(
            "the PR description would dirty the work tree; pick a path outside it",
            path=str(path),
        )
    if not out:
        _refuse_planted(own, want_dir=True)
    _refuse_planted(path)
    return path


@dataclass(frozen=True)
class Request:
    """One ``pr`` run's settings, checked before anything is written."""

    repo: git.Repo
    root: Path
    patch: Patch
    upstream: Upstream
    branch: str
    base: str | None
    identity: Identity
    description: Path
    """Where the PR description goes (outside the work tree)."""
    own_description: bool
    """The default path in the git directory (else ``--out``)."""
    evidence: tuple[Path, ...]
    format_patch: Path | None
    no_tests: bool
    pytest_k: str | None
    print_body: bool


def _request(args: argparse.Namespace) -> Request:
    """Every refusal that needs nothing written: a vLLM git checkout, clean, with
    a git identity; a valid branch name; outputs outside the work tree, with no
    link planted where they go."""
    repo = open_checkout(args.vllm)
    root = Path(repo.working_tree_dir)
    open_tree(root)  # a vLLM checkout at all? (exit 3 otherwise, nothing done)
    patch = pick_patch(args.patch)
    upstream = upstream_of(patch)
    branch = args.branch or upstream.branch
    try:
        named = repo.git.check_ref_format("--branch", branch)
    except git.GitCommandError:
        named = None
    if named != branch or branch.startswith("-"):  # @{-1} names another branch
        raise UsageError(f"not a valid branch name: {branch!r}")
    identity = git_identity(repo)
    refuse_dirty(repo)
    folder = args.format_patch
    if folder:
        if Path(folder).resolve().is_relative_to(root.resolve()):
            raise UsageError(
                "--format-patch DIR must be outside the work tree", path=str(folder)
            )
        _refuse_planted(Path(folder), want_dir=True)
    return Request(
        repo=repo,
        root=root,
        patch=patch,
        upstream=upstream,
        branch=branch,
        base=args.base,
        identity=identity,
        description=description_path(repo, branch, args.out),
        own_description=args.out is None,
        evidence=tuple(Path(d) for d in args.evidence or pr_body.DEFAULT_EVIDENCE),
        format_patch=Path(folder) if folder else None,
        no_tests=args.no_tests,
        pytest_k=args.pytest_k,
        print_body=args.print_body,
    )


class Checkout:
    """Where ``pr`` started, the branch it switched to, and how to go back."""

    def __init__(self, request: Request) -> None:
        repo, branch = request.repo, request.branch
        self.repo, self.branch, self.root = repo, branch, request.root
        self.start = (
            repo.head.commit.hexsha
            if repo.head.is_detached
            else repo.active_branch.name
        )
        exists = branch in repo.heads
        self.base_name = request.base
        """The base as the user named it; None for an existing branch without --base."""
        if exists and request.base:
            _, base_commit = resolve_base(repo, request.base)
            if not repo.is_ancestor(base_commit, repo.heads[branch].commit):
                raise UsageError(
                    f"branch {branch} exists and does not contain {request.base}; "
                    "pass --branch NEW or delete the branch",
                    path=str(request.root),
                )
        elif not exists:
            self.base_name, base_commit = resolve_base(repo, request.base)
        self.created, self.switched = not exists, exists and self.start != branch
        self.tip = None if self.created else repo.heads[branch].commit.hexsha
        self.new_files: list[str] = []
        """Files the patch created (gone again on rollback)."""
        if self.created:
            repo.git.checkout("-q", "-b", branch, base_commit.hexsha)
        elif self.switched:
            repo.git.checkout("-q", branch)

    def rollback(self) -> None:
        """Back on the starting branch, nothing committed, no file left."""
        g = self.repo.git
        if self.tip:
            g.reset("-q", "--hard", self.tip)
        g.checkout("-q", "-f", self.start)
        if self.created:
            g.branch("-D", self.branch)
        for rel in self.new_files:
            Path(self.root, rel).unlink(missing_ok=True)


@dataclass(frozen=True)
class Committed:
    """The patch's commit on the branch, new or found there."""

    plan: engine.PatchPlan
    commit: git.Commit | None
    """None: the branch has the change but no commit titled like the patch."""
    described: dict[str, list[str]]
    ci: CiEdit | None = None


def run(args: argparse.Namespace) -> int:
    """The steps in order; any failure after the branch switch restores the checkout."""
    request = _request(args)
    try:
        return _run(request)
    except git.GitCommandError as exc:
        said = (exc.stderr or "").strip().removeprefix("stderr:").strip(" '\n")
        raise UsageError(
            "git refused a step (the checkout's git config or hooks, as git itself "
            "runs them); the checkout is back where it was",
            path=str(request.root),
            looked_for=f"git {' '.join(map(str, exc.command[1:3]))} to succeed",
            found=said.splitlines()[-1] if said else f"exit status {exc.status}",
        ) from exc


def _run(request: Request) -> int:
    checkout = Checkout(request)
    try:
        committed = _commit(request, checkout)
        if committed is None:  # the base has the change already: no branch was made
            return ExitCode.OK
        body = _description(request, committed)
        _write_outputs(request, committed, body)
    except BaseException:
        checkout.rollback()
        raise
    if request.print_body:
        print("\n" + body)
    _print_next_steps(request, checkout)
    return ExitCode.OK


def _commit(request: Request, checkout: Checkout) -> Committed | None:
    """Apply the patch and commit it, or find the branch's commit of it; None when
    a new branch would be empty (then it is deleted again)."""
    repo, patch, root = request.repo, request.patch, request.root
    plan = engine.plan(open_tree(root), patch)
    if plan.errors:
        raise plan.errors[0]
    for w in plan.warnings:
        warn(w)
    if plan.status is PlanStatus.APPLIED:
        if checkout.created:
            checkout.rollback()
            print(
                f"{patch.name}: {checkout.base_name} already contains this change; "
                "nothing to commit, no branch created"
            )
            return None
        return _found_commit(request, checkout, plan)
    changes = plan.file_changes()
    checkout.new_files = [rel for rel in changes if not os.path.lexists(root / rel)]
    ci = request.upstream.ci and ci_yaml.wire(root, request.upstream.ci)
    if ci and ci.text is None:
        warn(f"{ci.wiring.file} left as it is: {ci.reason}")
    engine.apply(plan.tree, patch, planned=plan)
    formatting = check_changes(root, changes)
    files = list(changes)
    if ci and ci.text is not None:
        replace_at(root.resolve() / ci.wiring.file, ci.text.encode())
        files.append(ci.wiring.file)
    repo.git.add("--", *files)
    described = _with_ci(plan.described(), ci)
    message = commit_message(request.upstream, request.identity, described)
    repo.git.commit("--no-verify", "-q", "--cleanup=whitespace", "-m", message)
    commit = repo.head.commit
    print(
        f"{patch.name}: committed {commit.hexsha[:12]} on branch {request.branch}"
        f" (from {checkout.base_name or 'the existing branch'}): "
        f"{request.upstream.title}"
    )
    _report_format(formatting)
    return Committed(plan, commit, described, ci)


def _found_commit(
    request: Request, checkout: Checkout, plan: engine.PatchPlan
) -> Committed:
    """The existing branch's commit of the patch (found by its title)."""
    repo, patch, branch = request.repo, request.patch, request.branch
    commit = find_commit(repo, branch, request.upstream.title)
    where = f"as {commit.hexsha[:12]} " if commit else ""
    switch = " (switched to it)" if checkout.switched else ""
    print(
        f"{patch.name}: already committed {where}on branch {branch}{switch}; "
        "nothing changed"
    )
    if commit is None:
        return Committed(plan, None, {})
    described, ci = described_in_commit(repo, commit, patch, request.upstream)
    return Committed(plan, commit, described, ci)


def _tests(
    request: Request, plan: engine.PatchPlan, version
) -> vllm_tests.TestRun | None:
    """vLLM's tests of the edited test files, run now unless ``--no-tests`` or
    this machine has no matching vLLM: the user is told first that they are
    the checkout's code."""
    edited = [e.edit.file for e in plan.edits if e.edit.optional and not e.skipped]
    if not edited:
        return None
    why_not = "--no-tests" if request.no_tests else None
    why_not = why_not or vllm_tests.unavailable(request.root, edited, version)
    if why_not:
        command = vllm_tests.reviewer_command(edited, request.pytest_k)
        run = vllm_tests.TestRun(tuple(edited), command, ran=False, reason=why_not)
    else:
        print(
            f"upstream tests: running {', '.join(edited)} of the checkout: this runs "
            "the checkout's own code (the test files and what they import); "
            "--no-tests skips them",
            flush=True,
        )
        run = vllm_tests.measure(
            request.root, edited, request.patch, version, request.pytest_k
        )
    print(f"upstream tests: {run.summary() if run.ran else f'not run: {run.reason}'}")
    return run


def _description(request: Request, committed: Committed) -> str:
    """The PR description's text, with the upstream tests run now."""
    root, plan = request.root, committed.plan
    evidence = pr_body.load_evidence(list(request.evidence))
    for unreadable in evidence.unreadable:
        warn(f"evidence not read: {unreadable}")
    left_out = template.read_template(root).left_out
    if left_out:
        warn(f"PR template {left_out}; the fallback layout is used")
    version = checkout_version(request.repo, root)
    facts = pr_body.Facts(
        version=version,
        evidence=evidence,
        checkout=root,
        described=committed.described,
        tests_run=_tests(request, plan, version),
        left_out={e.edit.file: e.skipped.message for e in plan.skipped},
        ci=committed.ci,
    )
    return pr_body.render(request.patch, request.upstream, facts)


def _write_outputs(request: Request, committed: Committed, body: str) -> None:
    """The description, and with --format-patch the commit as an mbox patch for
    ``git am``: never through a link or special file found where they go."""
    out = request.description
    if request.own_description:  # out: in the resolved git directory
        output_dir(out.parent)
        replace_at(out, body.encode())
    else:
        write_output(out, body)
    print(f"PR description: {out}")
    if not request.format_patch:
        return
    if committed.commit is None:
        warn("no commit titled like the patch on the branch; no mbox written")
        return
    folder = output_dir(request.format_patch)
    with tempfile.TemporaryDirectory(prefix="vllm-patch-mbox-") as tmp:
        made = Path(
            request.repo.git.format_patch(
                "-1", committed.commit.hexsha, "-o", tmp
            ).strip()
        )
        written = write_output(folder / made.name, made.read_bytes())
    # Plain `git am` strips every leading [...] from the subject, the
    # [CPU][Kernel] tags included; -b (--keep-non-patch) keeps them.
    print(f"mbox patch: {written}")
    print(f"  apply with: git am --keep-non-patch {shlex.quote(str(written))}")


def _print_next_steps(request: Request, checkout: Checkout) -> None:
    """The push and ``gh pr create`` commands; nothing is pushed."""
    pr_base = _pr_base(request.repo, checkout.base_name)
    title = shlex.quote(request.upstream.title)
    print(
        "\nNothing was pushed. To open the pull request:\n"
        f"  git -C {shlex.quote(str(request.root))} push -u <your-fork-remote> "
        f"{request.branch}\n"
        f"  gh pr create --repo {UPSTREAM_REPO} --base {pr_base} "
        f"--head <your-github-user>:{request.branch} --title {title} "
        f"--body-file {shlex.quote(str(request.description))}"
    )


def _pr_base(repo: git.Repo, base_name: str | None) -> str:
    """The upstream branch to target: the base's branch name without its remote."""
    if base_name:
        for remote in repo.remotes:
            if base_name.startswith(f"{remote.name}/"):
                return base_name.split("/", 1)[1]
        if base_name in repo.heads:
            return base_name
    return "main"


def _report_format(report: FormatReport) -> None:
    if report.ruff:
        print(
            f"checked the changed lines with {report.ruff} "
            f"({report.config or 'ruff defaults'})"
        )
    for note in report.notes:
        warn(note)
