"""vLLM's source distributions for the tests that need a real vLLM checkout,
cached beside the wheels (``vllm_patch.runtime.cache``)."""

import os
import shutil
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

from packaging.utils import canonicalize_name

from vllm_patch.runtime.cache import cache_dir, pip_download


def fetch_sdist(package: str, version: str) -> Path:
    """The unpacked sdist of ``package==version``, cached. vLLM's metadata build
    fails without its build requirements: ``--no-clean`` keeps the tree pip
    unpacked (in ``TMPDIR``, here the cache); else pip saves the archive."""
    dest = cache_dir() / "sdists" / f"{canonicalize_name(package)}-{version}"
    if (dest / "PKG-INFO").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download-") as tmp:
        work = Path(tmp)
        spec = f"{package}=={version}"
        options = ("--no-binary=:all:", "--no-build-isolation", "--no-clean")
        env = {**os.environ, "TMPDIR": str(work)}  # the failing build's output kept
        run = dict(env=env, capture_output=True, text=True)
        done = pip_download(work / "saved", spec, *options, **run)
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
