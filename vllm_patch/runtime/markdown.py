"""Markdown, every string rendered as data: no HTML, link, image, heading, list,
emphasis, fence break or mention can come of one, as GitHub renders Markdown
(cmark-gfm with its extensions: tables, task lists, strikethrough and the
extended autolinks that make a bare ``https://...``, ``www.`` host or e-mail
address a link)."""

import html as _html
import re
from collections.abc import Iterable, Sequence

SHORT = 120  # characters of free text (a model's or a machine's name)
# What Markdown gives a meaning mid-line: these characters, a ``_`` not between
# two letters or digits (``x86_64`` stays), ``:`` before ``//`` and ``.`` after
# "www" (a backslash splits the text node, so cmark-gfm's extended autolinks
# find no ``https://...`` or ``www.host`` in it).
_PUNCT = re.compile(
    r"[\\`*\[\]<>&!~#]|(?<![^\W_])_|_(?![^\W_])|:(?=//)|(?<=www)\.",
    re.IGNORECASE,
)
# At the start of a line: what makes a list item, a setext heading or a break
# (``-``, ``+``, ``=``; digits then ``.`` or ``)``): a backslash goes before it.
_LEAD = re.compile(r"^(\d{1,9}(?=[.)](?:\s|$))|(?=[-+=]))")
_MENTION = "@\u200b"  # a zero-width space after @: no mention, no e-mail link


def printable(value: object, limit: int = SHORT) -> str:
    """``value`` on one line, unprintables and runs of spaces as one space, cut."""
    text = "".join(c if c.isprintable() else " " for c in str(value))
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def text(value: object, limit: int = SHORT) -> str:
    """``value`` as literal Markdown text: syntax escaped, ``@`` inert."""
    found = printable(value, limit)
    found = _PUNCT.sub(lambda m: "\\" + m[0], found)
    found = _LEAD.sub(r"\1\\", found)
    return found.replace("@", _MENTION)


def html(value: object, limit: int = SHORT) -> str:
    """``value`` as literal text inside an HTML element (``<summary>``)."""
    return _html.escape(printable(value, limit), quote=False).replace("@", _MENTION)


def code(value: object, limit: int = 1000) -> str:
    """``value`` as an inline code span no backtick run in it closes."""
    found = printable(value, limit)
    fence = "`" * (max(map(len, re.findall("`+", found)), default=0) + 1)
    pad = " " if found[:1] == "`" or found[-1:] == "`" else ""
    return f"{fence}{pad}{found}{pad}{fence}"


def fence(lines: Iterable[object], info: str = "", limit: int = 2000) -> str:
    """``lines`` as a fenced code block no backtick run in it can close."""
    body = [printable(line, limit) for line in lines]
    run = max((len(r) for b in body for r in re.findall("`+", b)), default=0)
    mark = "`" * max(3, run + 1)
    return "\n".join([f"{mark}{info}", *body, mark])


def cell(value: object) -> str:
    """None as ``-``; each ``|`` escaped (GitHub counts the backslashes before
    it)."""
    found = "-" if value is None else str(value).replace("\n", " ")
    return re.sub(
        r"(\\*)\|", lambda m: m[1] + "\\" * (1 + len(m[1]) % 2) + "|", found
    )


def table(
    header: Sequence[str],
    rows: Iterable[Sequence[object]],
    limit: int | None = None,
) -> str:
    """A GitHub table, numbers right-aligned, a note for rows past ``limit``."""
    rows = [list(r) for r in rows]
    left = len(rows) - limit if limit is not None and len(rows) > limit else 0
    rows = rows[: len(rows) - left]
    numeric = [
        bool(rows) and all(isinstance(r[i], int | float) for r in rows)
        for i in range(len(header))
    ]
    lines = [
        "| " + " | ".join(cell(h) for h in header) + " |",
        "|" + "|".join("---:" if n else "---" for n in numeric) + "|",
    ]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    if left:
        lines.append(f"\n({left:,} more rows left out here: too long to show)")
    return "\n".join(lines)


def details(summary: str, body: str) -> str:
    """``body`` collapsed under ``summary`` (HTML: :func:`html` data in it)."""
    return (
        f"<details>\n<summary>{summary}</summary>\n\n{body.strip()}\n\n</details>"
    )
