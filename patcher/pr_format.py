"""Format the lines a patch changed the way the checkout's own ruff settings ask,
so the commit passes vLLM's pre-commit.

Only the changed lines are formatted (``ruff format --range``), because a ruff
other than the one vLLM pins may format untouched code differently; a
``ruff check --fix`` that would touch lines outside the patch is not kept.
"""

from __future__ import annotations

import difflib
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PRE_COMMIT = ".pre-commit-config.yaml"
RUFF_REV = re.compile(r"astral-sh/ruff-pre-commit\s*\n\s*rev:\s*v?(\S+)")


@dataclass
class FormatReport:
    ruff: str | None = None
    """``ruff X.Y.Z`` that ran, or None when none was found."""
    config: str | None = None
    notes: list[str] = field(default_factory=list)


def find_ruff() -> Path | None:
    """ruff beside this interpreter (its venv), else on PATH."""
    beside = Path(sys.executable).parent / "ruff"
    if beside.is_file():
        return beside
    found = shutil.which("ruff")
    return Path(found) if found else None


def ruff_config(root: Path) -> Path | None:
    """The checkout's ruff settings: ruff.toml, .ruff.toml or pyproject [tool.ruff]."""
    for name in ("ruff.toml", ".ruff.toml"):
        if (root / name).is_file():
            return root / name
    pyproject = root / "pyproject.toml"
    if pyproject.is_file():
        try:
            if "ruff" in tomllib.loads(pyproject.read_text("utf-8")).get("tool", {}):
                return pyproject
        except tomllib.TOMLDecodeError:
            return None
    return None


def pinned_ruff(root: Path) -> str | None:
    """The ruff version vLLM's pre-commit pins, if the checkout says."""
    path = root / PRE_COMMIT
    if not path.is_file():
        return None
    found = RUFF_REV.search(path.read_text("utf-8", "replace"))
    return found.group(1) if found else None


def changed_ranges(before: str, after: str) -> list[tuple[int, int]]:
    """0-based ``[start, end)`` line ranges of ``after`` that differ from ``before``."""
    matcher = difflib.SequenceMatcher(
        None, before.splitlines(), after.splitlines(), autojunk=False
    )
    return [(j1, j2) for tag, _, _, j1, j2 in matcher.get_opcodes() if tag != "equal"]


def _inside(start: int, end: int, allowed: list[tuple[int, int]]) -> bool:
    return any(a <= start and end <= b for a, b in allowed)


def format_changes(root: Path, originals: dict[str, str]) -> FormatReport:
    """Format, in place, the changed lines of each ``relpath`` (text before the
    patch given) under ``root``."""
    report = FormatReport()
    ruff = find_ruff()
    files = " ".join(originals)
    if ruff is None:
        report.notes.append(
            "ruff not found: changed files left as the codemods wrote them; run "
            f"`pre-commit run --files {files}` in the checkout before pushing"
        )
        return report
    version = _run([str(ruff), "--version"], root).stdout.strip()
    report.ruff = version
    config = ruff_config(root)
    if config is None:
        report.notes.append(
            "no ruff settings at the checkout root (pyproject.toml [tool.ruff] or "
            "ruff.toml): formatted with ruff's defaults"
        )
        settings = ["--isolated"]
    else:
        report.config = str(config.relative_to(root))
        settings = ["--config", str(config)]
    pinned = pinned_ruff(root)
    if pinned and not version.endswith(f" {pinned}"):
        report.notes.append(
            f"{version} ran; the checkout's pre-commit pins ruff {pinned}: run "
            f"`pre-commit run --files {files}` to be sure"
        )
    for rel, before in originals.items():
        path = root / rel
        _format_ranges(ruff, settings, root, path, before, report)
        _fix_inside_patch(ruff, settings, root, path, before, report)
    return report


def _format_ranges(ruff, settings, root, path: Path, before: str, report) -> None:
    # Bottom-up, so formatting one range does not move the ones above it.
    for start, end in reversed(changed_ranges(before, path.read_text("utf-8"))):
        if start == end:
            continue  # a pure deletion leaves nothing to format
        lines = path.read_text("utf-8").count("\n")
        span = f"{start + 1}-{end + 1}" if end < lines else f"{start + 1}"
        done = _run(
            [str(ruff), "format", *settings, f"--range={span}", str(path)], root
        )
        if done.returncode != 0:
            report.notes.append(
                f"ruff format failed on {path.name}: {done.stderr.strip()}"
            )
            return


def _fix_inside_patch(ruff, settings, root, path: Path, before: str, report) -> None:
    patched = path.read_text("utf-8")
    allowed = changed_ranges(before, patched)
    _run([str(ruff), "check", *settings, "--fix", "--quiet", str(path)], root)
    fixed = path.read_text("utf-8")
    rel = path.relative_to(root).as_posix()
    outside = [
        (i1, i2)
        for tag, i1, i2, _, _ in difflib.SequenceMatcher(
            None, patched.splitlines(), fixed.splitlines(), autojunk=False
        ).get_opcodes()
        if tag != "equal" and not _inside(i1, i2, allowed)
    ]
    if outside:
        path.write_text(patched, "utf-8")
        report.notes.append(
            f"ruff check --fix would also change lines the patch does not touch in "
            f"{rel} (near lines {', '.join(str(a + 1) for a, _ in outside)}); not kept"
        )
    remaining = _run(
        [
            str(ruff),
            "check",
            *settings,
            "--output-format=json",
            "--exit-zero",
            str(path),
        ],
        root,
    )
    try:
        findings = json.loads(remaining.stdout or "[]")
    except json.JSONDecodeError:
        return
    final = changed_ranges(before, path.read_text("utf-8"))
    for f in findings:
        row = f.get("location", {}).get("row", 0) - 1
        if _inside(row, row + 1, final):
            report.notes.append(
                f"{rel}:{row + 1}: ruff {f.get('code')} {f.get('message')} (left as is)"
            )


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
