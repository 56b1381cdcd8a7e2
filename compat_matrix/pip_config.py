"""pip's configuration, carried over to uv (which does not read it).

The user's indexes, find-links and certificates live in pip's configuration;
a cell environment built with uv must see the same ones, or a local +cpu torch
found through pip's find-links would be "unavailable" to uv.
"""

from __future__ import annotations

import shutil
import subprocess
import sys


def pip_config() -> dict[str, str]:
    """``pip config list`` as key -> value, the environment over [install] over
    [global], as pip itself ranks them."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    )
    rank = {":env:": 3, "install": 2, "global": 1}
    best: dict[str, tuple[int, str]] = {}
    for line in proc.stdout.splitlines():
        key, sep, value = line.partition("=")
        section, _, name = key.partition(".")
        if not sep or section not in rank:
            continue
        value = value.strip().strip("'\"")
        if name not in best or rank[section] >= best[name][0]:
            best[name] = (rank[section], value)
    return {k: v for k, (_, v) in best.items()}


def uv_args_from_pip(config: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv command-line options and environment that carry pip's configuration."""
    args: list[str] = []
    env: dict[str, str] = {}
    if url := config.get("index-url"):
        args += ["--index-url", url]
    for url in config.get("extra-index-url", "").split():
        args += ["--extra-index-url", url]
    for link in config.get("find-links", "").split():
        args += ["--find-links", link]
    for constraint in config.get("constraint", "").split():
        args += ["--constraint", constraint]
    for host in config.get("trusted-host", "").split():
        args += ["--allow-insecure-host", host]
    if config.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        args.append("--no-index")
    if cert := config.get("cert"):
        env["SSL_CERT_FILE"] = cert
    if args:
        # pip picks the best version across all indexes; uv's default takes the
        # first index that has the name at all, which would hide a +cpu torch.
        args += ["--index-strategy", "unsafe-best-match"]
    return args, env


def find_uv() -> str | None:
    try:
        from uv import find_uv_bin  # the uv wheel ships its binary

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")
