"""``vllm-patch pr``: turn a carried patch into a commit on a branch of a vLLM
git checkout, ready for an upstream pull request: the engine's edit (one plan,
one write), the changed lines checked with the checkout's ruff settings, the
CI wiring, vLLM's tests of the edited files (the checkout's code: said first,
``--no-tests`` skips them), a vLLM-style title and a ``Signed-off-by:``, and
the PR description outside the work tree. It never pushes.

All or nothing: every refusal that needs nothing written comes first; any
failure after the branch switch (a git step the checkout's config or hooks
refuse included) leaves the checkout on its starting branch with nothing
committed. Exit 2: usage (see ``ExitCode``); 3: the patch cannot be applied.
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
from vllm_patch.upstream.pr_format import check_changes

UPSTREAM_REPO = "vllm-project/vllm"
WIDTH = 72
"""Commit message lines: git's convention, which vLLM's history follows."""
SAFE = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
OPTIONS = [  # (flag, METAVAR (None: a switch), help)
    ("--vllm", "CHECKOUT", "a clean vLLM git checkout (required)"),
    ("--patch", "NAME", "the patch; default: the form this release gets (`list`)"),
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
    parts.append(_wrap(pr_body.what_changes(described, mark="")))
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


def refuse_links(root: Path, files: list[str]) -> None:
    """The engine follows a link that stays in the tree, but git would commit
    the link, not the edit: a file the change edits or creates must be at its
    own path in the checkout, no link on the way."""
    real = Path(os.path.realpath(root))
    for rel in files:
        found = Path(os.path.realpath(root / rel))
        if found != real / rel:
            raise UsageError(
                "a file the change edits is reached through a link in the checkout",
                path=str(root / rel),
                looked_for="a regular file (or none) at that path, no link on the way",
                found=f"a link to {found.relative_to(real)}"
                if found.is_relative_to(real)
                else "a link out of the checkout",
            )


def _output(root: Path, path: Path, what: str, folder: bool = False, but=None) -> Path:
    """``path`` for an output: outside the work tree (``but`` excepted), and
    no link or special file (or, for a ``folder``, anything else) planted there."""
    real = path.parent.resolve() / path.name
    if real.is_relative_to(root.resolve()) and not (but and real.is_relative_to(but)):
        raise UsageError(f"{what} must be outside the work tree", path=str(path))
    mode = os.lstat(path).st_mode if os.path.lexists(path) else None
    if mode is not None and not (stat.S_ISDIR if folder else stat.S_ISREG)(mode):
        raise UsageError(
            "vllm-patch never writes through a link or special file it finds",
            path=str(path),
            looked_for="a folder" if folder else "a regular file or no file",
            found=kind(mode),
        )
    return path


class Run:
    """One ``pr`` run: its settings, checked before anything is written; the
    branch it switched to, and how to go back."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.repo = repo = open_checkout(args.vllm)
        self.root = root = Path(repo.working_tree_dir)
        tree = open_tree(root)  # a vLLM checkout at all? (exit 3 otherwise)
        self.patch = pick_patch(args.patch, tree)
        self.upstream = upstream_of(self.patch)
        self.branch = branch = args.branch or self.upstream.branch
        try:
            named = repo.git.check_ref_format("--branch", branch)
        except git.GitCommandError:
            named = None
        if named != branch or branch.startswith("-"):  # @{-1} names another branch
            raise UsageError(f"not a valid branch name: {branch!r}")
        self.identity = git_identity(repo)
        if not repo.head.is_valid():
            raise UsageError("the checkout has no commits", path=str(root))
        refuse_dirty(repo)
        git_dir = Path(repo.git_dir).resolve()
        self.own = args.out is None
        own = git_dir / "vllm-patch" / f"PR_{branch.replace('/', '_')}.md"
        out = Path(os.path.abspath(args.out or own))
        if self.own:
            _output(root, out.parent, "the PR description", folder=True, but=git_dir)
        self.description = _output(root, out, "the PR description", but=git_dir)
        self.mbox = args.format_patch
        if self.mbox:
            _output(root, self.mbox, "--format-patch DIR", folder=True)
        self.args = args
        self.evidence = pr_body.load_evidence(args.evidence, self.patch)
        self.new_files: list[str] = []
        """Files the patch created (gone again on rollback)."""
        head = repo.head
        self.start = head.commit.hexsha if head.is_detached else repo.active_branch.name
        self.created = branch not in repo.heads
        self.tip = None if self.created else repo.heads[branch].commit.hexsha
        self.base_name = args.base  # None: an existing branch without --base
        self.switched = False

    def switch(self) -> None:
        """Check out the branch: created from the base, or the existing one (which
        must contain the base, when one is given)."""
        repo, branch, base = self.repo, self.branch, self.args.base
        if self.created:
            self.base_name, commit = resolve_base(repo, base)
            repo.git.checkout("-q", "-b", branch, commit.hexsha)
            return
        if base and not repo.is_ancestor(resolve_base(repo, base)[1], self.tip):
            raise UsageError(
                f"branch {branch} exists and does not contain {base}; pass --branch "
                "NEW or delete the branch",
                path=str(self.root),
            )
        self.switched = self.start != branch
        if self.switched:
            repo.git.checkout("-q", branch)

    def rollback(self) -> None:
        """Back on the starting branch, nothing committed, no file left (git's
        hooks are not run: this undoes what ``pr`` did)."""
        repo = self.repo

        def git(*args: str) -> None:
            repo.git.execute(["git", "-c", "core.hooksPath=/dev/null", *args])

        if (
            self.tip
            and not repo.head.is_detached
            and repo.active_branch.name == self.branch
        ):
            git("reset", "-q", "--hard", self.tip)
        git("checkout", "-q", "-f", self.start)
        if self.created and self.branch in repo.heads:
            git("branch", "-D", self.branch)
        for rel in self.new_files:
            Path(self.root, rel).unlink(missing_ok=True)


@dataclass
class Committed:
    """The patch's commit on the branch: to be made, made, or found there."""

    plan: engine.PatchPlan
    commit: git.Commit | None
    """None: not made yet, or the branch has the change but no commit titled
    like the patch."""
    described: dict[str, list[str]]
    ci: CiEdit | None = None
    files: tuple[str, ...] = ()
    """What the commit to make holds."""


def run(args: argparse.Namespace) -> int:
    """The steps in order; any failure after the branch switch restores the checkout."""
    try:
        pr = Run(args)
        try:
            pr.switch()
            committed = _apply(pr)
            if committed is None:  # the base has the change already: no branch made
                return ExitCode.OK
            body = _description(pr, committed)  # vLLM's tests run before the commit
            if committed.commit is None and committed.files:
                committed.commit = _commit(pr, committed)
            _write_outputs(pr, committed, body)
        except BaseException:
            pr.rollback()
            raise
    except git.GitCommandError as exc:
        said = (exc.stderr or "").strip().removeprefix("stderr:").strip(" '\n")
        raise UsageError(
            "git refused a step (the checkout's git config or hooks, as git itself "
            "runs them); the checkout is back where it was",
            path=str(args.vllm),
            looked_for=f"git {' '.join(map(str, exc.command[1:3]))} to succeed",
            found=said.splitlines()[-1] if said else f"exit status {exc.status}",
        ) from exc
    if args.print:
        print("\n" + body)
    _print_next_steps(pr)
    return ExitCode.OK


def _apply(pr: Run) -> Committed | None:
    """Apply the patch (and the CI edit) to be committed, or find the branch's
    commit of it; None when a new branch would be empty (then it is deleted)."""
    plan = engine.plan(open_tree(pr.root), pr.patch)
    if plan.errors:
        raise plan.errors[0]
    for w in plan.warnings:
        warn(w)
    if plan.status is PlanStatus.APPLIED and pr.created:
        pr.rollback()
        print(
            f"{pr.patch.name}: {pr.base_name} already contains this change; "
            "nothing to commit, no branch created"
        )
        return None
    if plan.status is PlanStatus.APPLIED:
        return _found_commit(pr, plan)
    changes = plan.file_changes()
    refuse_links(pr.root, list(changes))
    pr.new_files = [rel for rel in changes if not os.path.lexists(pr.root / rel)]
    ci = pr.upstream.ci and ci_yaml.wire(pr.root, pr.upstream.ci)
    if ci and ci.text is None:
        warn(f"{ci.wiring.file} left as it is: {ci.reason}")
    engine.apply(plan.tree, plan)
    formatting = check_changes(pr.root, changes)
    files = list(changes)
    if ci and ci.text is not None:
        replace_at(pr.root.resolve() / ci.wiring.file, ci.text.encode())
        files.append(ci.wiring.file)
    if formatting.ruff:
        where = formatting.config or "ruff defaults"
        print(f"checked the changed lines with {formatting.ruff} ({where})")
    for note in formatting.notes:
        warn(note)
    return Committed(plan, None, _with_ci(plan.described(), ci), ci, files)


def _commit(pr: Run, done: Committed) -> git.Commit:
    """Commit the applied patch with a sign-off."""
    pr.repo.git.add("--", *done.files)
    message = commit_message(pr.upstream, pr.identity, done.described)
    pr.repo.git.commit("--no-verify", "-q", "--cleanup=whitespace", "-m", message)
    commit = pr.repo.head.commit
    print(
        f"{pr.patch.name}: committed {commit.hexsha[:12]} on branch {pr.branch} (from "
        f"{pr.base_name or 'the existing branch'}): {pr.upstream.title}"
    )
    return commit


def _found_commit(pr: Run, plan: engine.PatchPlan) -> Committed:
    """The existing branch's commit of the patch (found by its title)."""
    commits = pr.repo.iter_commits(pr.branch, max_count=200)
    commit = next((c for c in commits if c.summary == pr.upstream.title), None)
    where = f"as {commit.hexsha[:12]} " if commit else ""
    switch = " (switched to it)" if pr.switched else ""
    print(
        f"{pr.patch.name}: already committed {where}on branch {pr.branch}{switch}; "
        "nothing changed"
    )
    if commit is None:
        return Committed(plan, None, {})
    return Committed(
        plan, commit, *described_in_commit(pr.repo, commit, pr.patch, pr.upstream)
    )


def _tests(pr: Run, plan: engine.PatchPlan) -> vllm_tests.TestRuns | None:
    """vLLM's tests of the edited test files, run now unless ``--no-tests`` or
    this machine has no matching vLLM: the user is told first that they are
    the checkout's code."""
    edited = [e.edit.file for e in plan.edits if e.edit.optional and not e.skipped]
    if not edited:
        return None
    keyword = pr.args.pytest_k
    ci = pr.upstream.ci
    depends = vllm_tests.depends_on(pr.patch, ci.dependencies if ci else ())
    no_tests = pr.args.no_tests
    why_not = no_tests or vllm_tests.unavailable(pr.root, edited, pr.patch, depends)
    if why_not:
        command = vllm_tests.reviewer_command(edited, keyword)
        said = "skipped (--no-tests)" if no_tests else f"cannot run here ({why_not})"
        print(
            f"upstream tests: {said}; the PR description gives the reviewer's command"
        )
        return vllm_tests.TestRuns(vllm_tests.TestRun(command, ran=False, reason=said))
    runs = vllm_tests.measure(pr.root, edited, pr.patch, depends, keyword)
    after, before = runs.after, runs.before
    fails = f"; without the change: {before.summary()}" if before and before.ran else ""
    print(f"upstream tests: {after.summary() + fails if after.ran else after.reason}")
    return runs


def _description(pr: Run, committed: Committed) -> str:
    """The PR description's text, with the upstream tests run now."""
    left_out = template.read_template(pr.root).left_out
    if left_out:
        warn(f"PR template {left_out}; the fallback layout is used")
    facts = pr_body.Facts(
        version=checkout_version(pr.repo, pr.root),
        evidence=pr.evidence,
        checkout=pr.root,
        described=committed.described,
        tests=_tests(pr, committed.plan),
        left_out={e.edit.file: e.skipped.message for e in committed.plan.skipped},
        ci=committed.ci,
    )
    return pr_body.render(pr.patch, pr.upstream, facts)


def _write_outputs(pr: Run, committed: Committed, body: str) -> None:
    """The description, and with --format-patch the commit as an mbox patch for
    ``git am``: never through a link or special file found where they go."""
    if pr.own:  # in the resolved git directory: no link on the way
        output_dir(pr.description.parent)
        replace_at(pr.description, body.encode())
    else:
        write_output(pr.description, body)
    print(f"PR description: {pr.description}")
    if not pr.mbox:
        return
    if committed.commit is None:
        warn("no commit titled like the patch on the branch; no mbox written")
        return
    folder = output_dir(pr.mbox)
    with tempfile.TemporaryDirectory(prefix="vllm-patch-mbox-") as tmp:
        made = Path(pr.repo.git.format_patch("-1", committed.commit.hexsha, "-o", tmp))
        written = write_output(folder / made.name, made.read_bytes())
    # Plain `git am` strips every leading [...] from the subject, the
    # [CPU][Kernel] tags included; -b (--keep-non-patch) keeps them.
    print(f"mbox patch: {written}")
    print(f"  apply with: git am --keep-non-patch {shlex.quote(str(written))}")


def _print_next_steps(pr: Run) -> None:
    """The push and ``gh pr create`` commands; nothing is pushed."""
    base = pr.base_name or ""
    remote = next((r for r in pr.repo.remotes if base.startswith(f"{r.name}/")), None)
    pr_base = base.split("/", 1)[1] if remote else base or "main"
    pr_base = pr_base if remote or base in pr.repo.heads else "main"
    title = shlex.quote(pr.upstream.title)
    print(
        "\nNothing was pushed. To open the pull request:\n"
        f"  git -C {shlex.quote(str(pr.root))} push -u <your-fork-remote> {pr.branch}\n"
        f"  gh pr create --repo {UPSTREAM_REPO} --base {pr_base} "
        f"--head <your-github-user>:{pr.branch} --title {title} "
        f"--body-file {shlex.quote(str(pr.description))}"
    )
