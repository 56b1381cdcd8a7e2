"""Unified diffs that ``git apply`` accepts."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

NO_NEWLINE = "\\ No newline at end of file\n"


def unified_diff(relpath: str, before: str, after: str) -> str:
    """A ``diff --git`` hunk set for one file; line endings (CRLF too) are kept."""
    if before == after:
        return ""
    lines = [f"diff --git a/{relpath} b/{relpath}\n"]
    for line in difflib.unified_diff(
        before.splitlines(keepends=True),
        after.splitlines(keepends=True),
        f"a/{relpath}",
        f"b/{relpath}",
    ):
        lines.append(line if line.endswith("\n") else line + "\n" + NO_NEWLINE)
    return "".join(lines)


def combined_diff(files: Iterable[tuple[str, str, str]]) -> str:
    return "".join(unified_diff(*f) for f in files)
