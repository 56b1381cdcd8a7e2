"""What a vLLM release pins, and whether that torch can be obtained here.

Both questions go to the registry through pip (metadata only, nothing is
installed), so pip's own configuration decides which indexes count. A registry
that does not answer raises :class:`Unavailable`: the cell is then recorded as
``unavailable``, never as a failure of the patch.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement

from compat_matrix import versions
from compat_matrix.pip_config import pip_config
from vllm_patch.runtime.cache import cache_dir

# pip's words for "the registry did not answer", as opposed to "no such version".
NETWORK_ERRORS = (
    "NewConnectionError",
    "Max retries exceeded",
    "Failed to establish",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "Connection refused",
    "Read timed out",
    "ConnectTimeout",
    "ProxyError",
)


class Unavailable(RuntimeError):
    pass


# Resolve one requirement against the user's indexes without installing it.
DRY_RUN = ("install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet")


def _pip(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pip", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise Unavailable(f"{shlex.join(cmd)}: no answer in {timeout} s") from exc
    if "No module named pip" in proc.stderr:
        # Not the registry's fault: say so instead of calling torch unavailable.
        raise RuntimeError(
            f"{sys.executable} has no pip; install pip beside this project"
        )
    return proc


def read_pins(cell: versions.Cell, index_args: list[str]) -> dict[str, Any]:
    """The wheel's metadata (requires_dist, download URL) without downloading it.

    Cached per package version: a release's metadata never changes.
    """
    cache = cache_dir() / "compat" / "pins" / f"{cell.package}-{cell.version}.json"
    if cache.is_file():
        return json.loads(cache.read_text("utf-8"))
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        proc = _pip(
            *DRY_RUN,
            "--report",
            str(report),
            cell.requirement,
            *index_args,
        )
        if proc.returncode != 0 or not report.is_file():
            # The version is listed in versions.json, so a failure here means the
            # registry did not answer, not that the release is missing.
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise Unavailable(
                f"pip could not read {cell.requirement}'s metadata: {tail}"
            )
        item = json.loads(report.read_text("utf-8"))["install"][0]
    pins = {
        "requires_dist": item["metadata"].get("requires_dist", []),
        "url": item.get("download_info", {}).get("url"),
    }
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(pins, indent=1), "utf-8")
    return pins


def torch_pin(requires_dist: list[str]) -> str | None:
    """The torch requirement that applies here, e.g. ``torch==2.13.0+cpu``."""
    env = default_environment()
    for text in requires_dist:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.name == "torch" and (
            req.marker is None or req.marker.evaluate(env | {"extra": ""})
        ):
            return f"torch{req.specifier}"
    return None


def plain_build(pin: str) -> str | None:
    """``torch==2.11.0+cpu`` -> ``torch==2.11.0``: the same release without its
    local build label (PyPI's default build), or None when the pin has none."""
    try:
        req = Requirement(pin)
    except InvalidRequirement:
        return None
    specs = list(req.specifier)
    if len(specs) != 1 or specs[0].operator != "==" or "+" not in specs[0].version:
        return None
    return f"{req.name}=={specs[0].version.split('+')[0]}"


# How long a registry's answer about a torch build is reused: cells on the same
# torch (seven releases share 2.11.0) ask once, and a build published since is
# seen the next day.
TORCH_ANSWER_TTL_S = 24 * 3600


def torch_available(pin: str, index_args: list[str]) -> tuple[bool, str]:
    """(True, "") when pip can resolve ``pin``; (False, pip's last line) when
    the indexes answer without it. A silent registry raises Unavailable.

    Answers are cached for a day per pin and index configuration (pip's own,
    and ``index_args``): a pip resolution costs seconds to tens of seconds."""
    key = json.dumps([pin, index_args, pip_config()], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    cache = cache_dir() / "compat" / "torch-available" / f"{digest}.json"
    try:
        saved = json.loads(cache.read_text("utf-8"))
        if time.time() - saved["time"] < TORCH_ANSWER_TTL_S:
            return saved["ok"], saved["why"]
    except (OSError, ValueError, KeyError):
        pass
    proc = _pip(*DRY_RUN, pin, *index_args)
    if proc.returncode == 0:
        ok, why = True, ""
    elif any(marker in proc.stderr for marker in NETWORK_ERRORS):
        raise Unavailable(f"registry did not answer while resolving {pin}")
    else:
        ok, why = False, (proc.stderr.strip().splitlines() or ["not found"])[-1]
    cache.parent.mkdir(parents=True, exist_ok=True)
    record = {"pin": pin, "ok": ok, "why": why, "time": time.time()}
    cache.write_text(json.dumps(record), "utf-8")
    return ok, why
