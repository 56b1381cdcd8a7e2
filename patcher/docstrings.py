"""Add a sentence to a docstring, or take it out again, keeping its lines.

The docstring's lines stay as they are; the sentence goes at the end of its
last line when it fits there, else on lines of its own, wrapped to vLLM's line
length at the docstring's indentation. Taking it out is the exact inverse.
"""

from __future__ import annotations

import re
import textwrap

import libcst as cst

from patcher.ruff_format import LINE_LENGTH

QUOTES = ('"""', "'''")


def _parts(literal: str) -> tuple[str, str] | None:
    """(text before the closing quotes, the quotes) of a plain triple-quoted
    string; None for any other kind (prefixed, single-quoted)."""
    for quotes in QUOTES:
        if literal.startswith(quotes) and literal.endswith(quotes) and len(literal) > 5:
            return literal[: -len(quotes)], quotes
    return None


def with_sentence(literal: str, sentence: str, column: int, indent: str) -> str | None:
    """``literal`` (the source of a docstring starting at ``column``, its
    continuation lines indented with ``indent``) ending with ``sentence``; None
    when it is not a plain triple-quoted string."""
    parts = _parts(literal)
    if parts is None:
        return None
    text, quotes = parts
    last = text.rsplit("\n", 1)
    width = len(last[-1]) + (column if len(last) == 1 else 0)
    if width + 1 + len(sentence) + len(quotes) <= LINE_LENGTH:
        return f"{text} {sentence}{quotes}"
    # The closing quotes stick to the last word, so they fit on its line too.
    lines = textwrap.wrap(sentence + quotes, width=LINE_LENGTH - len(indent))
    return text + "".join(f"\n{indent}{line}" for line in lines)


def without_sentence(literal: str, sentence: str) -> str | None:
    """The inverse of :func:`with_sentence`; None when ``literal`` does not end
    with ``sentence`` (however it is wrapped)."""
    parts = _parts(literal)
    if parts is None:
        return None
    text, quotes = parts
    words = r"\s+".join(map(re.escape, sentence.split()))
    found = re.search(rf"[ \t]*\n?[ \t]*{words}$", text)
    if found is None or found.start() == 0:
        return None
    return text[: found.start()] + quotes


def docstring_of(body: list[cst.BaseStatement] | tuple, at: int):
    """The string statement at ``body[at]`` (a docstring), if there is one."""
    if at < len(body) and isinstance(body[at], cst.SimpleStatementLine):
        stmt = body[at].body
        if len(stmt) == 1 and isinstance(stmt[0], cst.Expr):
            if isinstance(stmt[0].value, cst.SimpleString):
                return stmt[0].value
    return None
