"""Check the lines a patch changed the way the checkout's own ruff settings ask,
so the commit passes vLLM's pre-commit.

The codemods already lay out what they write as vLLM's ruff does (the ruff
vllm-patch pins, see ``patcher.ruff_format``), so ``apply``, ``diff``, the
rendered patches and the commit are the same lines. Here the pinned ruff checks
them against the checkout's settings (``ruff format`` and ``ruff check`` on the
changed lines only, since a ruff other than the one vLLM pins may judge
untouched code differently) and reports what it would change; nothing is
rewritten.
"""

from __future__ import annotations

import difflib
import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from patcher.ruff_format import ruff_binary

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PRE_COMMIT = ".pre-commit-config.yaml"
RUFF_REV = re.compile(r"astral-sh/ruff-pre-commit\s*\n\s*rev:\s*v?(\S+)")


@dataclass
class FormatReport:
    ruff: str | None = None
    """``ruff X.Y.Z`` that ran."""
    config: str | None = None
    notes: list[str] = field(default_factory=list)


def find_ruff() -> Path:
    """The pinned ruff, not whichever one the checkout or PATH has."""
    return Path(ruff_binary())


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


def check_changes(root: Path, originals: dict[str, str]) -> FormatReport:
    """Check the changed lines of each ``relpath`` (text before the patch given)
    under ``root``; findings go to the report's notes."""
    report = FormatReport()
    ruff = find_ruff()
    files = " ".join(originals)
    version = _run([str(ruff), "--version"], root).stdout.strip()
    report.ruff = version
    config = ruff_config(root)
    if config is None:
        report.notes.append(
            "no ruff settings at the checkout root (pyproject.toml [tool.ruff] or "
            "ruff.toml): checked with ruff's defaults"
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
        after = (root / rel).read_text("utf-8")
        touched = changed_ranges(before, after)
        formatted = _run(
            [str(ruff), "format", *settings, "--stdin-filename", rel, "-"],
            root,
            after,
        )
        moved = [
            start + 1
            for start, end in changed_ranges(formatted.stdout, after)
            if formatted.returncode == 0 and _overlaps(start, end, touched)
        ]
        if moved:
            report.notes.append(
                f"{rel}: ruff format with the checkout's settings would lay out "
                f"lines near {', '.join(map(str, moved))} differently (left as is)"
            )
        _lint_inside_patch(ruff, settings, root, rel, touched, report)
    return report


def _overlaps(start: int, end: int, ranges: list[tuple[int, int]]) -> bool:
    return any(start < b and a < max(end, start + 1) for a, b in ranges)


def _lint_inside_patch(ruff, settings, root, rel: str, touched, report) -> None:
    remaining = _run(
        [
            str(ruff),
            "check",
            *settings,
            "--output-format=json",
            "--exit-zero",
            rel,
        ],
        root,
    )
    try:
        findings = json.loads(remaining.stdout or "[]")
    except json.JSONDecodeError:
        return
    for f in findings:
        row = f.get("location", {}).get("row", 0) - 1
        if _inside(row, row + 1, touched):
            report.notes.append(
                f"{rel}:{row + 1}: ruff {f.get('code')} {f.get('message')} (left as is)"
            )


def _run(
    cmd: list[str], cwd: Path, stdin: str | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=cwd, input=stdin, capture_output=True, text=True, check=False
    )
