"""The checkout's own pull request template, read and filled.

vLLM's template changes between releases (v0.27.0: Purpose / Test Plan / Test
Result; v0.32.0: Overview / Claims / Validation / Details), so nothing here
names a section: each heading (else its HTML comment) says what kinds of text
it asks for, and each piece of the description goes to the first section of a
kind it prefers. The tail (from a thematic break or ``<details>``: the
checklist) is the author's, kept with every box unticked. The template is data
(``read_text_in``: no link, at most ``MAX_BYTES``, UTF-8 without NUL, else left
out with the reason), parsed in linear time; a comment it leaves open is closed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from patcher.errors import PatchError
from patcher.files import read_text_in, refusal

TEMPLATE = ".github/PULL_REQUEST_TEMPLATE.md"
FALLBACK = "## Overview\n\n## Claims\n\n## Validation\n\n## Details\n"
"""The layout used where a checkout has no template (vLLM's newest headings)."""
MAX_BYTES = 16 << 10
"""vLLM's template is 1.5 kB (0.32.0); this bound keeps parsing and filling
a hostile one to milliseconds."""

KINDS = (
    ("purpose", ("purpose", "overview", "summary", "motivation", "description")),
    ("claims", ("claim", "accomplishment", "highlight")),
    ("plan", ("test plan", "validation", "how to test", "testing", "reproduce")),
    ("result", ("result", "validation", "evidence")),
    ("details", ("detail", "design", "implementation", "trade-off", "limitation")),
)
"""Kinds of text a section asks for, by the words that ask for it."""
ASKS = [(k, re.compile(rf"\b(?:{'|'.join(map(re.escape, ws))})")) for k, ws in KINDS]
HEADING = re.compile(r"#{1,6}[ \t]+(.*)")
TAIL = re.compile(r"^\s*(?:(?:-{3,}|\*{3,}|_{3,})\s*$|<details\b)")
TICKED = re.compile(r"^([ \t]*[-*][ \t]+)\[[xX]\]", re.MULTILINE)


@dataclass
class Section:
    heading: str
    """The heading line as the template writes it."""
    title: str
    body: str = ""
    """The template's text under the heading (its guidance comments)."""
    filled: list[str] = field(default_factory=list)

    @cached_property
    def kinds(self) -> tuple[str, ...]:
        for text in (self.title, " ".join(_html_comments(self.body))):
            found = tuple(kind for kind, asks in ASKS if asks.search(text.lower()))
            if found:
                return found
        return ()


@dataclass
class Template:
    head: str
    """Before the first heading: its comments (e.g. a linter directive)."""
    sections: list[Section]
    tail: str
    """From the thematic break or ``<details>`` after the sections: the checklist
    and the closing note, as they are."""
    found: bool
    """Read from the checkout (False: the fallback layout)."""
    left_out: str = ""
    """Why the checkout's template was not used (``left out: ...``), if it has one."""


def _html_comments(text: str) -> list[str]:
    """The closed ``<!-- ... -->`` comments of ``text``, found in linear time."""
    found, at = [], 0
    while (start := text.find("<!--", at)) >= 0 and (
        end := text.find("-->", start)
    ) >= 0:
        found.append(text[start : end + 3])
        at = end + 3
    return found


def read_template(root: Path | None) -> Template:
    """The checkout's template, or the fallback layout when it has none or it
    is left out (``left_out`` then says why)."""
    text, why = None, ""
    try:
        text = read_text_in(root, TEMPLATE, "the PR template", limit=MAX_BYTES)
    except PatchError as exc:
        why = f"left out: {TEMPLATE}: {refusal(exc)}"
    parsed = parse(text, found=True) if text else None
    if parsed and parsed.sections:
        return parsed
    fallback = parse(FALLBACK, found=False)
    fallback.left_out = why
    return fallback


def parse(text: str, *, found: bool = True) -> Template:
    """Headings (outside code fences) split ``text``; the first thematic break
    or ``<details>`` after a section starts the tail."""
    head: list[str] = []
    sections: list[tuple[Section, list[str]]] = []
    lines = text.splitlines(keepends=True)
    tail = ""
    fenced = False
    for i, line in enumerate(lines):
        fenced ^= line.lstrip().startswith("```")
        heading = None if fenced else HEADING.match(line)
        if heading:
            sections.append((Section(line.rstrip("\n"), _title(heading[1])), []))
        elif sections and not fenced and TAIL.match(line):
            tail = "".join(lines[i:])
            break
        else:
            (sections[-1][1] if sections else head).append(line)
    for section, body in sections:
        section.body = "".join(body)
    return Template(_comments(head), [s for s, _ in sections], tail, found)


def _title(text: str) -> str:
    """A heading's text without its closing ``#``s (string methods: a regular
    expression for it backtracks for minutes on a line of spaces)."""
    title = text.strip()
    bare = title.rstrip("#")
    return bare.rstrip() if not bare or bare[-1] in " \t" else title


def _comments(lines: list[str]) -> str:
    """Only the HTML comments: the template's instructions to the author
    (plain text before the first heading) are not part of a description."""
    return "\n".join(_html_comments("".join(lines)))


@dataclass(frozen=True)
class Piece:
    """A block of the description and the section kinds it may go to, in order
    of preference."""

    prefers: tuple[str, ...]
    text: str


def fill(template: Template, pieces: list[Piece], ticked: tuple[str, ...] = ()) -> str:
    """The template with every piece in its section; a section that gets none
    keeps its guidance for the author, a piece that has no section gets one of
    its own before the tail. In the tail every box is unticked but those whose
    line says one of ``ticked``."""
    for piece in pieces:
        if piece.text.strip():
            _place(template, piece)
    out = [template.head] if template.head else []
    for section in template.sections:
        body = "\n\n".join(section.filled) if section.filled else section.body.strip()
        out.append(_closed(f"{section.heading}\n\n{body}".rstrip()))
    if template.left_out:
        out.append(f"_The checkout's PR template was {template.left_out}._")
    text = "\n\n".join(out) + "\n"
    if template.tail:
        tail = TICKED.sub(r"\1[ ]", template.tail)
        for said in ticked:
            tail = re.sub(
                rf"^([ \t]*[-*][ \t]+)\[ \](?=.*{re.escape(said)})",
                r"\1[x]",
                tail,
                flags=re.MULTILINE,
            )
        text += "\n" + _closed(tail)
    return text.rstrip() + "\n"


def _closed(chunk: str) -> str:
    """``chunk`` with an HTML comment it leaves open closed at its end."""
    return chunk + " -->" if chunk.rfind("<!--") > chunk.rfind("-->") else chunk


def _place(template: Template, piece: Piece) -> None:
    for kind in piece.prefers:
        for section in template.sections:
            if kind in section.kinds:
                section.filled.append(piece.text.strip())
                return
    title = piece.prefers[0].capitalize()
    template.sections.append(Section(f"## {title}", title, filled=[piece.text]))
