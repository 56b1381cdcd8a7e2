"""The user cache: real vLLM wheels, downloaded once."""

import os
import subprocess
import sys
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

# Not VLLM_*: vLLM warns about every VLLM_* variable it does not know.
CACHE_ENV = "VLLMPATCH_CACHE"


def cache_dir() -> Path:
    """``$VLLMPATCH_CACHE``, else ``$XDG_CACHE_HOME/vllm-patch``,
    else ``~/.cache``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vllm-patch"


def pip_download(folder: Path, spec: str, *options: str, **run):
    """``pip download --no-deps`` (with the user's index, proxies)."""
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-q"]
    pip += ["--disable-pip-version-check", "-d", str(folder), spec, *options]
    return subprocess.run(pip, **run)


def fetch_wheel(package: str, version: str) -> Path:
    """The wheel of ``package==version``, from the cache or via ``pip download``."""
    folder = cache_dir() / "wheels"
    spec = f"{package}=={version}"
    for download in (False, True):
        if download:
            folder.mkdir(parents=True, exist_ok=True)
            pip_download(folder, spec, "--only-binary=:all:", check=True)
        for wheel in sorted(folder.glob("*.whl")):
            name, ver, _, _ = parse_wheel_filename(wheel.name)
            if name == canonicalize_name(package) and str(ver) == version:
                return wheel
    raise FileNotFoundError(f"pip download left no wheel for {spec}")
