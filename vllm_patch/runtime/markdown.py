"""The one way vllm-patch writes Markdown: tables and collapsed sections, for
every report (bench, matrix, doctor, PR description)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def cell(value: object) -> str:
    """A value as a table cell: ``|`` escaped, newlines as spaces, None as ``-``."""
    text = "-" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table; numbers right-aligned by column
    when every value in it is a number."""
    rows = [list(r) for r in rows]
    numeric = [
        bool(rows) and all(isinstance(r[i], int | float) for r in rows)
        for i in range(len(header))
    ]
    lines = [
        "| " + " | ".join(cell(h) for h in header) + " |",
        "|" + "|".join("---:" if n else "---" for n in numeric) + "|",
    ]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def details(summary: str, body: str) -> str:
    """``body`` collapsed under ``summary`` (GitHub's ``<details>``)."""
    return f"<details>\n<summary>{summary}</summary>\n\n{body.strip()}\n\n</details>"
