"""Unified diffs that ``git apply`` accepts."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

NO_NEWLINE = "\\ No newline at end of file\n"


def unified_diff(relpath: str, before: str | None, after: str | None) -> str:
    """A ``diff --git`` hunk set for one file (None: the file is absent); line
    endings (CRLF too) are kept."""
    if before == after:
        return ""
    lines = [f"diff --git a/{relpath} b/{relpath}\n"]
    if before is None:
        lines.append("new file mode 100644\n")
    if after is None:
        lines.append("deleted file mode 100644\n")
    for line in difflib.unified_diff(
        (before or "").splitlines(keepends=True),
        (after or "").splitlines(keepends=True),
        "/dev/null" if before is None else f"a/{relpath}",
        "/dev/null" if after is None else f"b/{relpath}",
    ):
        lines.append(line if line.endswith("\n") else line + "\n" + NO_NEWLINE)
    return "".join(lines)


def combined_diff(files: Iterable[tuple[str, str | None, str | None]]) -> str:
    return "".join(unified_diff(*f) for f in files)
