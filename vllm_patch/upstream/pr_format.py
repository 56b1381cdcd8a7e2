"""Check the lines a patch changed the way the checkout's own ruff settings ask,
so the commit passes vLLM's pre-commit. The codemods already lay out what they
write as the pinned ruff does (``patcher.ruff_format``); here it runs ``ruff
format`` and ``ruff check`` with the checkout's settings on the changed lines
only (another ruff may judge untouched code differently) and reports, never
rewrites. The settings are data: only their style tables reach a ruff that
reads no settings file and writes no cache.
"""

from __future__ import annotations

import difflib
import json
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from patcher.errors import PatchError
from patcher.files import read_text_in, refusal
from patcher.ruff_format import ruff_binary

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PRE_COMMIT = ".pre-commit-config.yaml"
RUFF_REV = re.compile(r"astral-sh/ruff-pre-commit[ \t]*\r?\n[ \t]*rev:[ \t]*v?(\S+)")
CONFIG_FILES = [
    ("ruff.toml", ()),
    (".ruff.toml", ()),
    ("pyproject.toml", ("tool", "ruff")),
]
SETTINGS = {
    "line-length",
    "indent-width",
    "target-version",
    "preview",
    "lint",
    "format",
}
"""The settings passed on to ruff; the rest (``cache-dir``, ``extend``, ``fix``,
``output-file``, ``exclude`` ...) could make it read or write elsewhere."""


@dataclass
class FormatReport:
    ruff: str | None = None
    """``ruff X.Y.Z`` that ran."""
    config: str | None = None
    notes: list[str] = field(default_factory=list)


def find_ruff() -> Path:
    """The pinned ruff, not whichever one the checkout or PATH has."""
    return Path(ruff_binary())


def ruff_settings(root: Path, notes: list[str]) -> tuple[str | None, list[str]]:
    """(the file the checkout's ruff settings are in, ruff's arguments): always
    ``--isolated --no-cache``, the settings passed one table at a time, so no
    file of the checkout tells ruff where to read or write."""
    # src: where first-party packages are (import sorting); ruff only looks.
    argv = ["--isolated", "--no-cache", "--config", f"src = [{json.dumps(str(root))}]"]
    for name, keys in CONFIG_FILES:
        try:
            text = read_text_in(root, name, "ruff settings")
            table = tomllib.loads(text) if text is not None else None
        except (PatchError, tomllib.TOMLDecodeError, RecursionError) as exc:
            why = refusal(exc) if isinstance(exc, PatchError) else "not TOML"
            notes.append(f"{name} left out ({why}): checked with ruff's defaults")
            return None, argv
        for key in keys:
            table = table.get(key) if isinstance(table, dict) else None
        if isinstance(table, dict):
            for key, value in table.items():
                if key in SETTINGS:
                    argv += ["--config", f"{key} = {_toml(value)}"]
            return name, argv
    notes.append(
        "no ruff settings at the checkout root (pyproject.toml [tool.ruff] or "
        "ruff.toml): checked with ruff's defaults"
    )
    return None, argv


def _toml(value: object) -> str:
    """``value`` (from a TOML document) spelled as a TOML value."""
    if isinstance(value, dict):
        pairs = (f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items())
        return "{" + ", ".join(pairs) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(map(_toml, value)) + "]"
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value, default=str)  # a JSON string or number is TOML's


def pinned_ruff(root: Path) -> str | None:
    """The ruff version vLLM's pre-commit pins, if the checkout says."""
    try:
        text = read_text_in(root, PRE_COMMIT, "pre-commit settings", limit=1 << 20)
    except PatchError:
        return None
    found = RUFF_REV.search(text or "")
    return found.group(1) if found else None


def changed_ranges(before: str, after: str) -> list[tuple[int, int]]:
    """0-based ``[start, end)`` line ranges of ``after`` that differ from ``before``."""
    matcher = difflib.SequenceMatcher(
        None, before.splitlines(), after.splitlines(), autojunk=False
    )
    return [(j1, j2) for tag, _, _, j1, j2 in matcher.get_opcodes() if tag != "equal"]


def check_changes(root: Path, changes: dict[str, tuple[str, str]]) -> FormatReport:
    """Check the changed lines of each ``relpath`` (its text before and after
    the patch given); findings go to the report's notes. Ruff reads the source
    on stdin and runs in an empty folder: it reads and writes no file."""
    report = FormatReport()
    ruff = str(find_ruff())
    report.config, settings = ruff_settings(root, report.notes)
    with tempfile.TemporaryDirectory(prefix="vllm-patch-ruff-") as cwd:
        version = _run([ruff, "--version"], cwd).stdout.strip()
        report.ruff = version
        pinned = pinned_ruff(root)
        if pinned and not version.endswith(f" {pinned}"):
            report.notes.append(
                f"{version} ran; the checkout's pre-commit pins ruff {pinned}: run "
                f"`pre-commit run --files {' '.join(changes)}` to be sure"
            )
        for rel, (before, after) in changes.items():
            stdin = [*settings, "--stdin-filename", rel, "-"]
            touched = changed_ranges(before or "", after)  # None: a new file
            formatted = _run([ruff, "format", *stdin], cwd, after)
            moved = [
                start + 1
                for start, end in changed_ranges(formatted.stdout, after)
                if formatted.returncode == 0 and _overlaps(start, end, touched)
            ]
            if moved:
                report.notes.append(
                    f"{rel}: ruff format with the checkout's settings would lay "
                    f"out lines near {', '.join(map(str, moved))} differently "
                    "(left as is)"
                )
            lint = [ruff, "check", "--no-fix", "--output-format=json", "--exit-zero"]
            _lint_inside_patch(_run([*lint, *stdin], cwd, after), rel, touched, report)
    return report


def _overlaps(start: int, end: int, ranges: list[tuple[int, int]]) -> bool:
    return any(start < b and a < max(end, start + 1) for a, b in ranges)


def _lint_inside_patch(done, rel: str, touched, report: FormatReport) -> None:
    try:
        findings = json.loads(done.stdout or "[]")
    except json.JSONDecodeError:
        report.notes.append(f"{rel}: ruff check did not run with these settings")
        return
    for f in findings:
        row = f.get("location", {}).get("row", 0) - 1
        if _overlaps(row, row + 1, touched):
            report.notes.append(
                f"{rel}:{row + 1}: ruff {f.get('code')} {f.get('message')} (left as is)"
            )


def _run(cmd: list[str], cwd: str, stdin: str | None = None):
    return subprocess.run(
        cmd, cwd=cwd, input=stdin, capture_output=True, text=True, check=False
    )
