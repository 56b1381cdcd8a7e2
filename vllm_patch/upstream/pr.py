"""``vllm-patch pr``: turn a carried patch into a commit on a branch of a vLLM
git checkout, ready for an upstream pull request.

It creates (or reuses) a branch, applies the patch with the engine, checks the
changed lines against the checkout's ruff settings, commits with a vLLM-style
title and a DCO ``Signed-off-by:``, and writes the PR description outside the
work tree (default ``<git-dir>/vllm-patch/PR_<branch>.md``). It never pushes
and never calls a web API: it prints the commands that would.

Exit codes: 0 committed, or already committed (nothing changed); 2 usage (not a
git checkout, dirty tree, detached HEAD without --base, unknown base, missing
git identity, output inside the work tree); 3 the patch cannot be applied to
the base. Every refusal happens before anything is written, and a failure after
the branch was created puts the checkout back as it was.
"""

from __future__ import annotations

import argparse
import shlex
import tarfile
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import git
from packaging.version import InvalidVersion, Version

from patcher import engine
from patcher.errors import ExitCode, PatchError, UsageError, warn
from patcher.patchset import Patch
from patcher.status import PlanStatus
from patcher.tree import open_tree
from patcher.version import read_version
from vllm_patch.upstream import ci_yaml, pr_body, vllm_tests
from vllm_patch.upstream.ci_yaml import CiEdit
from vllm_patch.upstream.meta import Upstream, pick_patch, upstream_of
from vllm_patch.upstream.pr_format import FormatReport, check_changes

UPSTREAM_REPO = "vllm-project/vllm"
WIDTH = 72
"""Commit message lines: git's convention, which vLLM's history follows."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--vllm",
        metavar="CHECKOUT",
        required=True,
        help="a git checkout of vLLM (work tree root); must be clean",
    )
    parser.add_argument(
        "--patch", metavar="NAME", help="the patch; default: the only one"
    )
    parser.add_argument(
        "--branch",
        metavar="NAME",
        help="branch to create or reuse; default: the patch's",
    )
    parser.add_argument(
        "--base",
        metavar="REF",
        help="branch, tag or commit to start from (e.g. upstream/main); default: the "
        "current branch",
    )
    parser.add_argument(
        "--format-patch",
        metavar="DIR",
        type=Path,
        help="also write the commit as an mbox patch (git am) into DIR",
    )
    parser.add_argument(
        "--evidence",
        metavar="DIR",
        type=Path,
        action="append",
        help="read compat cells and bench JSON from DIR (repeatable); default: the "
        "project's compat_matrix/results and vllm_patch/bench/reference",
    )
    parser.add_argument(
        "--out",
        metavar="FILE",
        type=Path,
        help="where to write the PR description (outside the work tree); default: "
        "<git-dir>/vllm-patch/PR_<branch>.md",
    )
    parser.add_argument(
        "--pytest-k",
        metavar="EXPR",
        help="run only the upstream tests matching EXPR (pytest -k) for the Test "
        "Result; default: every test of the edited files",
    )
    parser.add_argument(
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
    parts = [_wrap(upstream.body)]
    if upstream.rule:
        parts.append(_wrap(upstream.rule))
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
    return [
        f"- {rel}: {change}" for rel, changes in described.items() for change in changes
    ]


def described_in_commit(
    repo: git.Repo, commit, patch: Patch, upstream: Upstream
) -> tuple[dict[str, list[str]], CiEdit | None]:
    """What the patch changes in ``commit``'s parent, as the codemods describe it,
    and the CI edit made there (for a branch that already carries the commit)."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "parent.tar"
        parent = f"{commit.hexsha}^"
        wanted = [e.file for e in patch.test_edits]
        wanted += [upstream.ci.file] if upstream.ci else []
        present = [
            f for f in wanted if repo.git.ls_tree("--name-only", parent, "--", f)
        ]
        repo.git.archive("--format=tar", "-o", str(archive), parent, "vllm", *present)
        with tarfile.open(archive) as tar:
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(tmp, **safe)
        ci = ci_yaml.wire(Path(tmp), upstream.ci) if upstream.ci else None
        return _with_ci(engine.plan(open_tree(tmp), patch).described(), ci), ci


def _with_ci(
    described: dict[str, list[str]], ci: CiEdit | None
) -> dict[str, list[str]]:
    """The codemods' changes, and the CI file's when it is edited."""
    if ci is None or ci.text is None:
        return described
    return {**described, ci.wiring.file: ci.described()}


def find_commit(repo: git.Repo, branch: str, title: str, stop: str | None):
    rev = f"{stop}..{branch}" if stop else branch
    for c in repo.iter_commits(rev, max_count=200):
        if c.summary == title:
            return c
    return None


def description_path(repo: git.Repo, branch: str, out: Path | None) -> Path:
    root = Path(repo.working_tree_dir).resolve()
    git_dir = Path(repo.git_dir).resolve()
    path = (
        out or git_dir / "vllm-patch" / f"PR_{branch.replace('/', '_')}.md"
    ).resolve()
    if path.is_relative_to(root) and not path.is_relative_to(git_dir):
        raise UsageError(
            "the PR description would dirty the work tree; pick a path outside it",
            path=str(path),
        )
    return path


class Rollback:
    """Put the checkout back where it was if anything fails before the commit."""

    def __init__(self, repo: git.Repo, start: str, branch: str, created: bool):
        self.repo, self.start, self.branch, self.created = repo, start, branch, created

    def __call__(self) -> None:
        g = self.repo.git
        g.checkout("-f", self.start)
        if self.created:
            g.branch("-D", self.branch)


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
    evidence: tuple[Path, ...]
    format_patch: Path | None
    pytest_k: str | None
    print_body: bool


@dataclass(frozen=True)
class OnBranch:
    """Where ``pr`` started, and the branch it switched to."""

    start: str
    """The branch (or detached commit) to go back to on failure."""
    base_name: str | None
    """The base as the user named it; None for an existing branch without --base."""
    created: bool
    switched: bool
    """An existing branch, other than the one checked out, was checked out."""


@dataclass(frozen=True)
class Committed:
    """The patch's commit on the branch, new or found there."""

    plan: engine.PatchPlan
    commit: git.Commit | None
    """None: the branch has the change but no commit titled like the patch."""
    described: dict[str, list[str]]
    ci: CiEdit | None = None


def run(args: argparse.Namespace) -> int:
    """The steps in order; a failure before the commit restores the checkout."""
    request = _request(args)
    on_branch = _switch_branch(request)
    committed = _commit(request, on_branch)
    if committed is None:  # the base has the change already: no branch was made
        return ExitCode.OK
    body = _write_description(request, committed)
    _write_mbox(request, committed)
    if request.print_body:
        print("\n" + body)
    _print_next_steps(request, on_branch)
    return ExitCode.OK


def _request(args: argparse.Namespace) -> Request:
    """Every refusal that needs nothing written: a vLLM git checkout, clean, with
    a git identity; a valid branch name; outputs outside the work tree."""
    repo = open_checkout(args.vllm)
    root = Path(repo.working_tree_dir)
    open_tree(root)  # a vLLM checkout at all? (exit 3 otherwise, nothing done)
    patch = pick_patch(args.patch)
    upstream = upstream_of(patch)
    branch = args.branch or upstream.branch
    try:
        repo.git.check_ref_format("--branch", branch)
    except git.GitCommandError as exc:
        raise UsageError(f"not a valid branch name: {branch!r}") from exc
    identity = git_identity(repo)
    refuse_dirty(repo)
    description = description_path(repo, branch, args.out)
    if args.format_patch and Path(args.format_patch).resolve().is_relative_to(
        root.resolve()
    ):
        raise UsageError(
            "--format-patch DIR must be outside the work tree",
            path=str(args.format_patch),
        )
    return Request(
        repo=repo,
        root=root,
        patch=patch,
        upstream=upstream,
        branch=branch,
        base=args.base,
        identity=identity,
        description=description,
        evidence=tuple(Path(d) for d in args.evidence or pr_body.DEFAULT_EVIDENCE),
        format_patch=Path(args.format_patch) if args.format_patch else None,
        pytest_k=args.pytest_k,
        print_body=args.print_body,
    )


def _switch_branch(request: Request) -> OnBranch:
    """Check out the branch: created from the base, or the existing one (which
    must contain the base, when one is given)."""
    repo, branch = request.repo, request.branch
    start = (
        repo.head.commit.hexsha if repo.head.is_detached else repo.active_branch.name
    )
    exists = branch in repo.heads
    if exists:
        base_name = request.base
        if request.base:
            _, base_commit = resolve_base(repo, request.base)
            if not repo.is_ancestor(base_commit, repo.heads[branch].commit):
                raise UsageError(
                    f"branch {branch} exists and does not contain {request.base}; "
                    "pass --branch NEW or delete the branch",
                    path=str(request.root),
                )
    else:
        base_name, base_commit = resolve_base(repo, request.base)
    switched = exists and start != branch
    if not exists:
        repo.git.checkout("-q", "-b", branch, base_commit.hexsha)
    elif switched:
        repo.git.checkout("-q", branch)
    return OnBranch(start, base_name, created=not exists, switched=switched)


def _commit(request: Request, on_branch: OnBranch) -> Committed | None:
    """Apply the patch and commit it, or find the branch's commit of it; None when
    a new branch would be empty (then it is deleted again)."""
    repo, patch = request.repo, request.patch
    rollback = Rollback(repo, on_branch.start, request.branch, on_branch.created)
    try:
        plan = engine.plan(open_tree(request.root), patch)
        if plan.errors:
            raise plan.errors[0]
        for w in plan.warnings:
            warn(w)
        already = plan.status is PlanStatus.APPLIED
        if already and on_branch.created:
            rollback()
            print(
                f"{patch.name}: {on_branch.base_name} already contains this change; "
                "nothing to commit, no branch created"
            )
            return None
        made = None if already else _apply_and_commit(request, plan)
    except BaseException:
        rollback()
        raise
    if made is None:
        return _found_commit(request, on_branch, plan)
    formatting, ci = made
    commit = repo.head.commit
    print(
        f"{patch.name}: committed {commit.hexsha[:12]} on branch {request.branch}"
        f" (from {on_branch.base_name or 'the existing branch'}): "
        f"{request.upstream.title}"
    )
    _report_format(formatting)
    return Committed(plan, commit, _with_ci(plan.described(), ci), ci)


def _found_commit(
    request: Request, on_branch: OnBranch, plan: engine.PatchPlan
) -> Committed:
    """The existing branch's commit of the patch (found by its title)."""
    repo, patch, branch = request.repo, request.patch, request.branch
    commit = find_commit(repo, branch, request.upstream.title, None)
    where = f"as {commit.hexsha[:12]} " if commit else ""
    switch = " (switched to it)" if on_branch.switched else ""
    print(
        f"{patch.name}: already committed {where}on branch {branch}{switch}; "
        "nothing changed"
    )
    if commit is None:
        return Committed(plan, None, {})
    described, ci = described_in_commit(repo, commit, patch, request.upstream)
    return Committed(plan, commit, described, ci)


def _before_commit(request: Request, plan: engine.PatchPlan) -> CiEdit | None:
    """Say what cannot be done here (the tests, the CI wiring) before the
    commit is made; the CI edit to make."""
    edited = _edited_tests(plan)
    version = checkout_version(request.repo, request.root)
    why_not = vllm_tests.unavailable(request.root, edited, version) if edited else None
    if why_not:
        print(
            f"upstream tests: cannot run here ({why_not}); the PR description "
            "gives the command a reviewer runs instead"
        )
    ci = request.upstream.ci
    edit = ci_yaml.wire(request.root, ci) if ci else None
    if edit is not None and edit.text is None:
        warn(f"{ci.file} left as it is: {edit.reason}")
    return edit


def _edited_tests(plan: engine.PatchPlan) -> list[str]:
    return [e.edit.file for e in plan.edits if e.edit.optional and not e.skipped]


def _apply_and_commit(
    request: Request, plan: engine.PatchPlan
) -> tuple[FormatReport, CiEdit | None]:
    """Write ``plan`` and the CI edit, check the changed lines' format, commit
    with a sign-off."""
    ci = _before_commit(request, plan)
    originals = {rel: before for rel, (before, _) in plan.file_changes().items()}
    engine.apply(plan.tree, request.patch, planned=plan)
    formatting = check_changes(request.root, originals)
    files = list(originals)
    if ci is not None and ci.text is not None:
        _replace(request.root / ci.wiring.file, ci.text)
        files.append(ci.wiring.file)
    request.repo.git.add("--", *files)
    described = _with_ci(plan.described(), ci)
    message = commit_message(request.upstream, request.identity, described)
    request.repo.git.commit("--no-verify", "-q", "--cleanup=whitespace", "-m", message)
    return formatting, ci


def _replace(path: Path, text: str) -> None:
    """Write ``text`` as a new file renamed over ``path`` (never in place)."""
    new = path.with_name(f".{path.name}.new")
    new.write_text(text, "utf-8")
    new.replace(path)


def _write_description(request: Request, committed: Committed) -> str:
    """The PR description, with the upstream tests of the edited test files run
    now when this machine has the matching vLLM; its text."""
    root, plan = request.root, committed.plan
    evidence = pr_body.load_evidence(list(request.evidence))
    for unreadable in evidence.unreadable:
        warn(f"evidence not read: {unreadable}")
    version = checkout_version(request.repo, root)
    edited = _edited_tests(plan)
    tests_run = None
    if edited:
        tests_run = vllm_tests.measure(
            root, edited, request.patch, version, request.pytest_k
        )
        outcome = (
            tests_run.summary() if tests_run.ran else f"not run: {tests_run.reason}"
        )
        print(f"upstream tests: {outcome}")
    facts = pr_body.Facts(
        version=version,
        evidence=evidence,
        checkout=root,
        described=committed.described,
        tests_run=tests_run,
        left_out={e.edit.file: e.skipped.message for e in plan.skipped},
        ci=committed.ci,
    )
    body = pr_body.render(request.patch, request.upstream, facts)
    out = request.description
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(body, "utf-8")
    print(f"PR description: {out}")
    return body


def _write_mbox(request: Request, committed: Committed) -> None:
    """With --format-patch: the commit as an mbox patch for ``git am``."""
    if not request.format_patch:
        return
    if committed.commit is None:
        warn("no commit titled like the patch on the branch; no mbox written")
        return
    folder = request.format_patch
    folder.mkdir(parents=True, exist_ok=True)
    written = request.repo.git.format_patch(
        "-1", committed.commit.hexsha, "-o", str(folder.resolve())
    ).strip()
    # Plain `git am` strips every leading [...] from the subject, the
    # [CPU][Kernel] tags included; -b (--keep-non-patch) keeps them.
    print(f"mbox patch: {written}")
    print(f"  apply with: git am --keep-non-patch {shlex.quote(written)}")


def _print_next_steps(request: Request, on_branch: OnBranch) -> None:
    """The push and ``gh pr create`` commands; nothing is pushed."""
    pr_base = _pr_base(request.repo, on_branch.base_name)
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
        where = report.config or "ruff defaults"
        print(f"checked the changed lines with {report.ruff} ({where})")
    for note in report.notes:
        warn(note)
