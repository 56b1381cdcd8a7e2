"""The user cache: real vLLM wheels, downloaded once and reused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

# Not VLLM_*: vLLM warns about every VLLM_* variable it does not know.
CACHE_ENV = "VLLMPATCH_CACHE"


def cache_dir() -> Path:
    """``$VLLMPATCH_CACHE``, else ``$XDG_CACHE_HOME/vllm-patch``, else ``~/.cache``."""
    if env := os.environ.get(CACHE_ENV):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vllm-patch"


def fetch_wheel(package: str, version: str, *extra_pip_args: str) -> Path:
    """The wheel of ``package==version``, from the cache or via ``pip download``.

    pip honours the user's configuration (index, find-links, proxies).
    """
    folder = cache_dir() / "wheels"
    found = _cached(folder, package, version)
    if found:
        return found
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
            str(folder),
            f"{package}=={version}",
            *extra_pip_args,
        ],
        check=True,
    )
    found = _cached(folder, package, version)
    if not found:
        raise FileNotFoundError(f"pip download left no wheel for {package}=={version}")
    return found


def _cached(folder: Path, package: str, version: str) -> Path | None:
    for wheel in sorted(folder.glob("*.whl")) if folder.is_dir() else []:
        name, ver, _, _ = parse_wheel_filename(wheel.name)
        if name == canonicalize_name(package) and str(ver) == version:
            return wheel
    return None
