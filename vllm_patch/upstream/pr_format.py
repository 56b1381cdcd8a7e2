"""The changed lines checked with the checkout's pinned ruff and typos; reported."""

import difflib
import json
import os
import re
import subprocess
import tempfile
import zipfile
from pathlib import Path

from patcher.errors import PatchError
from patcher.files import read_text_in, refusal
from vllm_patch.upstream.ruff_package import ruff_binary

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PRE_COMMIT = ".pre-commit-config.yaml"
# A hook's rev: a tag (v0.14.0) or, as `pre-commit autoupdate --freeze` writes it
# (vLLM 0.34 on), a commit and `# frozen: v0.17.2`.
REV = (
    r"{repo}[ \t]*\r?\n[ \t]*rev:[ \t]*v?([\w.]+)"
    r"(?:[ \t]*#[ \t]*frozen:[ \t]*v?([\w.]+))?"
)
TOOLS = {"ruff": "astral-sh/ruff-pre-commit", "typos": "crate-ci/typos"}
CONFIG_FILES = {
    "ruff.toml": (),
    ".ruff.toml": (),
    "pyproject.toml": ("tool", "ruff"),
}
# Passed on to ruff; the rest (cache-dir, extend, output-file ...) could make it
# read or write elsewhere.
SETTINGS = "line-length indent-width target-version preview lint format".split()


def pinned_tool(name: str, version: str | None, notes: list[str]) -> str | None:
    """The ``name==version`` wheel's binary, cached; else None (and a note)."""
    from vllm_patch.runtime.cache import cache_dir, fetch_wheel

    binary = cache_dir() / "tools" / f"{name}-{version}" / name
    if version is None or binary.is_file():
        return version and str(binary)
    part = binary.with_suffix(".part")
    try:
        with zipfile.ZipFile(fetch_wheel(name, version)) as zf:
            script = f".data/scripts/{name}"
            member = next(n for n in zf.namelist() if n.endswith(script))
            binary.parent.mkdir(parents=True, exist_ok=True)
            part.write_bytes(zf.read(member))
        part.chmod(0o755)
        os.replace(part, binary)
    except (OSError, StopIteration, subprocess.CalledProcessError) as exc:
        notes.append(f"{name} {version} (pinned) could not be had: {exc}")
        return None
    return str(binary)


def ruff_settings(root: Path, notes: list[str]) -> list[str]:
    """``--isolated --no-cache`` and the checkout's ``SETTINGS``, one by one."""
    # src: where first-party packages are (import sorting); ruff only looks.
    src = f"src = [{json.dumps(str(root))}]"
    argv = ["--isolated", "--no-cache", "--config", src]
    for name, keys in CONFIG_FILES.items():
        try:
            text = read_text_in(root, name, "ruff settings")
            table = tomllib.loads(text) if text is not None else None
        except (PatchError, tomllib.TOMLDecodeError, RecursionError) as exc:
            why = refusal(exc) if isinstance(exc, PatchError) else "not TOML"
            notes.append(f"{name} left out ({why}): checked with ruff's defaults")
            return argv
        for key in keys:
            table = table.get(key) if isinstance(table, dict) else None
        if isinstance(table, dict):
            for key, value in table.items():
                if key in SETTINGS:
                    argv += ["--config", f"{key} = {_toml(value)}"]
            return argv
    notes.append(
        "no ruff settings at the checkout root (pyproject.toml [tool.ruff] or "
        "ruff.toml): checked with ruff's defaults"
    )
    return argv


def _toml(value: object) -> str:
    """``value`` (from a TOML document) spelled as a TOML value."""
    if isinstance(value, dict):
        pairs = (f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items())
        return "{" + ", ".join(pairs) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(map(_toml, value)) + "]"
    return json.dumps(value, default=str)  # JSON's strings, numbers, true: TOML's


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
    """0-based ``[start, end)`` line ranges of ``after`` that differ from
    ``before``."""
    matcher = difflib.SequenceMatcher(
        None, before.splitlines(), after.splitlines(), autojunk=False
    )
    return [
        (j1, j2) for tag, _, _, j1, j2 in matcher.get_opcodes() if tag != "equal"
    ]


def check_changes(
    root: Path, changes: dict[str, tuple[str, str]]
) -> tuple[str, list[str]]:
    """The ruff that ran, and ruff's and typos' notes on the changed lines."""
    notes: list[str] = []
    pins = {name: pinned_version(root, hook) for name, hook in TOOLS.items()}
    ruff = pinned_tool("ruff", pins["ruff"], notes) or ruff_binary()
    settings = ruff_settings(root, notes)
    with tempfile.TemporaryDirectory(prefix="vllm-patch-ruff-") as cwd:
        version = _capture([ruff, "--version"], cwd).stdout.strip()
        if pins["ruff"] and not version.endswith(f" {pins['ruff']}"):
            notes.append(
                f"{version} ran; the checkout's pre-commit pins ruff "
                f"{pins['ruff']}: run `pre-commit run --files {' '.join(changes)}` "
                "to be sure"
            )
        for rel, (before, after) in changes.items():
            stdin = [*settings, "--stdin-filename", rel, "-"]
            notes += _ruff_notes(ruff, stdin, cwd, rel, (before or "", after))
    typos = pinned_tool("typos", pins["typos"], notes)
    if typos:  # as pre-commit runs it
        done = _capture(
            [typos, "--force-exclude", "--format=brief", *changes], root
        )
        notes += [f"typos: {line}" for line in done.stdout.splitlines()[:20]]
    return version, notes


def _ruff_notes(ruff: str, settings: list[str], cwd: str, rel: str, sides):
    """What ``ruff format`` and ``ruff check`` say of the changed lines."""
    before, after = sides
    touched = changed_ranges(before, after)

    def near(start: int, end: int) -> bool:  # overlaps a changed range
        return any(start < b and a < max(end, start + 1) for a, b in touched)

    formatted = _capture([ruff, "format", *settings], cwd, after)
    moved = [
        start + 1
        for start, end in changed_ranges(formatted.stdout, after)
        if formatted.returncode == 0 and near(start, end)
    ]
    if moved:
        yield (
            f"{rel}: ruff format with the checkout's settings would lay out lines "
            f"near {', '.join(map(str, moved))} differently (left as is)"
        )
    lint = [ruff, "check", "--no-fix", "--output-format=json", "--exit-zero"]
    try:
        printed = _capture([*lint, *settings], cwd, after).stdout
        findings = json.loads(printed or "[]")
    except json.JSONDecodeError:
        yield f"{rel}: ruff check did not run with these settings"
        return
    for f in findings:
        row = f.get("location", {}).get("row", 0)
        if near(row - 1, row):
            code = f.get("code")
            yield f"{rel}:{row}: ruff {code} {f.get('message')} (left as is)"


def _capture(cmd: list[str], cwd: str | Path, stdin: str | None = None):
    return subprocess.run(
        cmd, cwd=cwd, input=stdin, capture_output=True, text=True, check=False
    )
