"""When a cell may reuse its last probe instead of running a new one.

What the probe's outcome depends on: the environment (its stamp) and the code
it runs from this project: the probe, the patches (loaded by name from their
patch.toml) and every project module they import, followed through imports.
An unchanged key means a re-run would repeat the last probe, so a warm re-run
reuses it (``--fresh`` forces a new one). Only a passing one: a failure may come
from something the key does not see (an environment rebuilt or broken since, a
machine under load, a flaky download), and reusing it would repeat a failure
nothing re-checked.
"""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path
from typing import Any

from compat_matrix.cell_env import PROJECT, STAMP

PROBE_SEEDS = (
    "compat_matrix/__init__.py",
    "compat_matrix/probe",
    "patches",
    "pyproject.toml",
)


# What the static checks on a wheel run: the same reuse, keyed on the wheel.
STATIC_SEEDS = ("compat_matrix/static.py", "patches", "pyproject.toml")


def probed_files(seeds_from: tuple[str, ...] = PROBE_SEEDS) -> list[Path]:
    seeds: list[Path] = []
    for entry in seeds_from:
        path = PROJECT / entry
        seeds += (
            [path]
            if path.is_file()
            else sorted(
                p
                for p in path.rglob("*")
                if p.suffix in (".py", ".toml") and p.is_file()
            )
        )
    seen: set[Path] = set()
    todo = list(seeds)
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        if f.suffix == ".py":
            todo += _project_imports(f)
    return sorted(seen)


def _project_imports(file: Path) -> list[Path]:
    try:
        tree = ast.parse(file.read_bytes())
    except SyntaxError:
        return []
    package = file.relative_to(PROJECT).parent.parts
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            mod = base + (node.module.split(".") if node.module else [])
            names += [".".join(mod + [a.name]) for a in node.names] + [".".join(mod)]
    found = []
    for name in names:
        parts = name.split(".")
        for candidate in (
            PROJECT.joinpath(*parts).with_suffix(".py"),
            PROJECT.joinpath(*parts, "__init__.py"),
        ):
            if parts and parts[0] and candidate.is_file():
                found.append(candidate)
    return found


def probe_key(env: Path, probe_kwargs: dict[str, Any]) -> str:
    digest = hashlib.sha256()
    digest.update((env / STAMP).read_bytes())
    digest.update(json.dumps(probe_kwargs, sort_keys=True).encode())
    for f in probed_files():
        digest.update(str(f.relative_to(PROJECT)).encode())
        digest.update(f.read_bytes())
    return digest.hexdigest()[:20]


def static_key(wheel: Path) -> str:
    """What the static checks' outcome depends on: the wheel (a release's wheel
    never changes: its name and size) and the code they run."""
    digest = hashlib.sha256(f"{wheel.name} {wheel.stat().st_size}".encode())
    for f in probed_files(STATIC_SEEDS):
        digest.update(str(f.relative_to(PROJECT)).encode())
        digest.update(f.read_bytes())
    return digest.hexdigest()[:20]


def _previous(path: Path, field: str, key: str) -> dict[str, Any]:
    """The result at ``path`` when its ``field`` is ``key``, else {}."""
    try:
        previous = json.loads(path.read_text("utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return previous if previous.get(field) == key else {}


def previous_static(path: Path, key: str) -> dict[str, Any] | None:
    """The static checks of the result at ``path`` when made under ``key`` and
    passed."""
    static = _previous(path, "static_key", key).get("static") or {}
    return static if static.get("ok") is True else None


def previous_probe(path: Path, key: str) -> dict[str, Any] | None:
    """The result at ``path`` when its probe was made under ``key`` and passed."""
    previous = _previous(path, "probe_key", key)
    return previous if (previous.get("probe") or {}).get("ok") is True else None
