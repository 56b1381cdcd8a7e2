"""A cell's virtual environment: its vLLM, the torch it pins, and this project.

Environments live under the env root, one per version, built with uv when it is
installed (hard links from uv's cache, so every cell shares one copy of torch
on disk) and plain venv + pip otherwise. A stamp file in each environment says
what was installed; a matching stamp means the environment is reused as is. The
project is installed editable, so code changes need no reinstall; a changed
``pyproject.toml`` reinstalls the project alone (its entry points and metadata
live in the environment), and only changed dependencies rebuild the environment.

Where the pinned ``+cpu`` torch is not on the user's indexes, PyPI's plain build
of the same torch release stands in for it (``uv pip install --override``: pip
has no way to replace a dependency's pin). That build is the CUDA one and brings
its ``nvidia-*`` wheels (without them ``import torch`` fails), about 5.6 GB per
environment, shared through uv's cache by every environment on that torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from compat_matrix import versions
from compat_matrix.log import log
from compat_matrix.pip_config import find_uv, pip_config, uv_args_from_pip
from vllm_patch.runtime.cpu_torch import BROKEN_BESIDE_CPU_TORCH

PROJECT = Path(__file__).resolve().parent.parent
STAMP = "compat-stamp.json"


class EnvError(RuntimeError):
    pass


def env_dir(cell: versions.Cell, env_root: Path) -> Path:
    return env_root / f"{cell.package}-{cell.version}"


def env_python(env: Path) -> Path:
    return env / "bin" / "python"


def installer() -> str:
    return "uv" if find_uv() else "pip"


def project_requirements() -> list[str]:
    meta = tomllib.loads((PROJECT / "pyproject.toml").read_text("utf-8"))
    return list(meta["project"].get("dependencies", []))


def read_stamp(env: Path) -> dict | None:
    try:
        return json.loads((env / STAMP).read_text("utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def _stamp(
    cell: versions.Cell,
    pin: str,
    torch_req: str,
    torch_index: str | None,
    installer: str,
) -> dict:
    return {
        "requirement": cell.requirement,
        "torch": pin,
        "torch_installed": torch_req,
        "torch_index": torch_index,
        "installer": installer,
        "python": platform.python_version(),
        "project": str(PROJECT),
        "dependencies": project_requirements(),
    }


def _project_hash() -> str:
    return hashlib.sha256((PROJECT / "pyproject.toml").read_bytes()).hexdigest()[:16]


def ensure_env(
    cell: versions.Cell,
    wheel: Path,
    pin: str,
    *,
    env_root: Path,
    torch_index: str | None,
    torch_req: str | None = None,
) -> tuple[Path, bool]:
    """The cell's environment, reused when its stamp matches; (env, reused).

    ``torch_req`` is the torch to install when it is not ``pin`` itself: a
    stand-in, installed over the wheel's pin (uv only)."""
    uv = find_uv()
    env = env_dir(cell, env_root)
    torch_req = torch_req or pin
    stamp = _stamp(cell, pin, torch_req, torch_index, "uv" if uv else "pip")
    stamp_file = env / STAMP
    found = read_stamp(env) or {}
    installed_from = found.pop("pyproject", None)
    project = {"pyproject": _project_hash()}
    if env_python(env).exists() and found == stamp:
        if installed_from != project["pyproject"]:  # new metadata or entry points
            _install_project(env, uv)
            stamp_file.write_text(json.dumps(stamp | project, indent=1))
        return env, True
    if torch_req != pin and not uv:
        raise EnvError(f"{torch_req} standing in for {pin} needs uv (pip cannot)")
    if env.exists():
        shutil.rmtree(env)
    env_root.mkdir(parents=True, exist_ok=True)
    extra = ["--extra-index-url", torch_index] if torch_index else []
    # The wheel already fetched for the static checks, so it is not downloaded twice.
    wanted = [str(wheel), torch_req, *project_requirements()]
    if uv:
        override = torch_req if torch_req != pin else None
        _build_with_uv(env, uv, extra, wanted, torch_index, override)
    else:
        _build_with_pip(env, extra, wanted)
    _install_project(env, uv)
    stamp_file.write_text(json.dumps(stamp | project, indent=1))
    return env, False


def _build_with_uv(
    env: Path,
    uv: str,
    extra: list[str],
    wanted: list[str],
    torch_index: str | None,
    override: str | None,
) -> None:
    """A uv venv with ``wanted`` installed; ``override`` is a torch requirement
    standing in for the wheel's pin."""
    args, uv_env = uv_args_from_pip(pip_config())
    if torch_index and "--index-strategy" not in args:
        # uv would otherwise take every package the torch index also lists
        # (numpy, requests, ...) from that index alone, at its old versions.
        args += ["--index-strategy", "unsafe-best-match"]
    run_env = os.environ | uv_env
    python = ["--python", str(env_python(env))]
    # Bytecode compiled at install, as pip does: otherwise the first probe
    # compiles torch's and vLLM's modules as it imports them, single-threaded.
    install = [uv, "pip", "install", "--quiet", "--link-mode=hardlink"]
    install += ["--compile-bytecode", *python]
    _run([uv, "venv", "--quiet", "--python", sys.executable, str(env)], run_env)
    if override:  # one file per environment: cells may build at once
        override_file = env / "torch-override.txt"
        override_file.write_text(override + "\n", "utf-8")
        args += ["--override", str(override_file)]
    _run([*install, *args, *extra, *wanted], run_env)
    _run(
        [uv, "pip", "uninstall", "--quiet", *python, *BROKEN_BESIDE_CPU_TORCH],
        run_env,
    )


def _build_with_pip(env: Path, extra: list[str], wanted: list[str]) -> None:
    pip = [str(env_python(env)), "-m", "pip"]
    _run([sys.executable, "-m", "venv", str(env)])
    _run([*pip, "install", "--quiet", *extra, *wanted])
    _run([*pip, "uninstall", "--quiet", "-y", *BROKEN_BESIDE_CPU_TORCH])


def _install_project(env: Path, uv: str | None) -> None:
    """This project, editable, without its dependencies (already there)."""
    if uv:
        args, uv_env = uv_args_from_pip(pip_config())
        _run(
            [uv, "pip", "install", "--quiet", "--python", str(env_python(env))]
            + [*args, "--no-deps", "-e", str(PROJECT)],
            os.environ | uv_env,
        )
    else:
        pip = [str(env_python(env)), "-m", "pip", "install", "--quiet"]
        _run([*pip, "--no-deps", "-e", str(PROJECT)])


def _run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    log(shlex.join(cmd))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise EnvError(
            f"{shlex.join(cmd[:4])} ... exited {proc.returncode}: "
            f"{proc.stderr.strip()[-2000:]}"
        )


def installed_torch(env: Path) -> str | None:
    proc = subprocess.run(
        [
            str(env_python(env)),
            "-c",
            "import importlib.metadata as m; print(m.version('torch'))",
        ],
        capture_output=True,
        text=True,
    )
    return proc.stdout.strip() or None
