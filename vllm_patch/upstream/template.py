"""The checkout's own pull request template, read and filled.

vLLM's template changes between releases (v0.27.0: Purpose / Test Plan / Test
Result and an "Essential Elements" checklist; v0.32.0: Overview / Claims /
Validation / Details and a "Pull Request Checklist"), so nothing here names a
section: a template is Markdown headings, each with the HTML comment that says
what belongs there, then a tail (a thematic break or ``<details>``: the
checklist). Each section is given the kinds of text it asks for by the words
of its heading (else of its comment), and each piece of the description goes
to the first section of the kind it prefers. The checklist is the author's: it
is kept as the template has it, every box unticked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

TEMPLATE = ".github/PULL_REQUEST_TEMPLATE.md"
FALLBACK = "## Overview\n\n## Claims\n\n## Validation\n\n## Details\n"
"""The layout used where a checkout has no template (vLLM's newest headings)."""

KINDS = (
    ("purpose", ("purpose", "overview", "summary", "motivation", "description")),
    ("claims", ("claim", "accomplishment", "highlight")),
    ("plan", ("test plan", "validation", "how to test", "testing", "reproduce")),
    ("result", ("result", "validation", "evidence")),
    ("details", ("detail", "design", "implementation", "trade-off", "limitation")),
)
"""Kinds of text a section asks for, by the words that ask for it."""
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
COMMENT = re.compile(r"<!--(.*?)-->", re.DOTALL)
TAIL = re.compile(r"^\s*(?:(?:-{3,}|\*{3,}|_{3,})\s*$|<details\b)")
TICKED = re.compile(r"^(\s*[-*]\s+)\[[xX]\]", re.MULTILINE)


@dataclass
class Section:
    heading: str
    """The heading line as the template writes it."""
    title: str
    body: str = ""
    """The template's text under the heading (its guidance comments)."""
    filled: list[str] = field(default_factory=list)

    @property
    def kinds(self) -> tuple[str, ...]:
        for text in (self.title, " ".join(COMMENT.findall(self.body))):
            found = tuple(kind for kind, words in KINDS if _says(text, words))
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


def _says(text: str, words: tuple[str, ...]) -> bool:
    low = text.lower()
    return any(re.search(rf"\b{re.escape(w)}", low) for w in words)


def read_template(root: Path | None) -> Template:
    """The checkout's template, or the fallback layout when it has none."""
    path = root / TEMPLATE if root else None
    if path is not None and path.is_file():
        parsed = parse(path.read_text("utf-8"), found=True)
        if parsed.sections:
            return parsed
    return parse(FALLBACK, found=False)


def parse(text: str, *, found: bool = True) -> Template:
    """Headings (outside code fences) split ``text``; the first thematic break
    or ``<details>`` after a section starts the tail."""
    head: list[str] = []
    sections: list[Section] = []
    lines = text.splitlines(keepends=True)
    fenced = False
    for i, line in enumerate(lines):
        fenced ^= line.lstrip().startswith("```")
        heading = None if fenced else HEADING.match(line)
        if heading:
            sections.append(Section(line.rstrip("\n"), heading.group(2)))
        elif sections and not fenced and TAIL.match(line):
            return Template(_comments(head), sections, "".join(lines[i:]), found)
        elif sections:
            sections[-1].body += line
        else:
            head.append(line)
    return Template(_comments(head), sections, "", found)


def _comments(lines: list[str]) -> str:
    """Only the HTML comments: the template's instructions to the author
    (plain text before the first heading) are not part of a description."""
    return "\n".join(m.group(0) for m in COMMENT.finditer("".join(lines)))


@dataclass(frozen=True)
class Piece:
    """A block of the description and the section kinds it may go to, in order
    of preference."""

    prefers: tuple[str, ...]
    text: str


def fill(template: Template, pieces: list[Piece]) -> str:
    """The template with every piece in its section; a section that gets none
    keeps its guidance for the author, a piece that has no section gets one of
    its own before the tail."""
    for piece in pieces:
        if piece.text.strip():
            _place(template, piece)
    out = [template.head] if template.head else []
    for section in template.sections:
        body = "\n\n".join(section.filled) if section.filled else section.body.strip()
        out.append(f"{section.heading}\n\n{body}".rstrip())
    text = "\n\n".join(out) + "\n"
    if template.tail:
        text += "\n" + TICKED.sub(r"\1[ ]", template.tail)
    return text.rstrip() + "\n"


def _place(template: Template, piece: Piece) -> None:
    for kind in piece.prefers:
        for section in template.sections:
            if kind in section.kinds:
                section.filled.append(piece.text.strip())
                return
    title = piece.prefers[0].capitalize()
    template.sections.append(Section(f"## {title}", title, filled=[piece.text]))
