"""The checkout's PR template, filled: a heading (else its comment) names the kinds
of text it asks for; the tail (the checklist) stays. Data, parsed in linear time."""

import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from patcher.errors import PatchError
from patcher.files import read_text_in, refusal

TEMPLATE = ".github/PULL_REQUEST_TEMPLATE.md"
# vLLM's newest template's headings
FALLBACK = "## Overview\n\n## Claims\n\n## Validation\n\n## Details\n"
TEMPLATE_BYTES = 16 << 10  # vLLM's is 1.5 kB (0.32.0): a hostile one fills in ms
KINDS = (  # kinds of text a section asks for, by the words that ask for it
    ("purpose", ("purpose", "overview", "summary", "motivation", "description")),
    ("claims", ("claim", "accomplishment", "highlight")),
    ("plan", ("test plan", "validation", "how to test", "testing", "reproduce")),
    ("result", ("result", "validation", "evidence")),
    ("details", ("detail", "design", "implementation", "trade-off", "limitation")),
)
ASKS = [
    (k, re.compile(rf"\b(?:{'|'.join(map(re.escape, ws))})")) for k, ws in KINDS
]
HEADING = re.compile(r"#{1,6}[ \t]+(.*)")
TAIL = re.compile(r"^\s*(?:(?:-{3,}|\*{3,}|_{3,})\s*$|<details\b)")
TICKED = re.compile(r"^([ \t]*[-*][ \t]+)\[[xX]\]", re.MULTILINE)
BOX = re.compile(r"^[ \t]*[-*][ \t]+\[[ xX]\][ \t]+(.+)$", re.MULTILINE)


@dataclass
class Section:
    heading: str  # the line as the template writes it
    title: str
    body: str = ""  # the template's text under the heading (its guidance)
    filled: list[str] = field(default_factory=list)

    @cached_property
    def kinds(self) -> tuple[str, ...]:
        for text in (self.title, " ".join(_html_comments(self.body))):
            found = tuple(k for k, asks in ASKS if asks.search(text.lower()))
            if found:
                return found
        return ()


@dataclass
class Template:
    head: str  # the comments before the first heading (e.g. a linter directive)
    sections: list[Section]
    tail: str  # from the break after the sections: the checklist, as it is
    left_out: str = ""  # why the checkout's template was not used, if it has one


@dataclass(frozen=True)
class Piece:  # a block of the description, and the kinds it prefers, in order
    prefers: tuple[str, ...]
    text: str


def _html_comments(text: str) -> list[str]:
    """The closed ``<!-- ... -->`` comments of ``text``, found in linear time."""
    parts = text.split("-->")[:-1]  # each closed by the next "-->"
    return [p[p.index("<!--") :] + "-->" for p in parts if "<!--" in p]


def read_template(root: Path | None) -> Template:
    """The checkout's template, else the fallback (``left_out`` says why)."""
    why = ""
    try:
        text = read_text_in(root, TEMPLATE, "the PR template", limit=TEMPLATE_BYTES)
        parsed = parse_template(text or "")
        if parsed.sections:
            return parsed
    except PatchError as exc:
        why = f"left out: {TEMPLATE}: {refusal(exc)}"
    return replace(parse_template(FALLBACK), left_out=why)


def parse_template(text: str) -> Template:
    """Headings outside fences split ``text``; a thematic break or ``<details>``
    starts the tail. Before the first heading, only the HTML comments stay."""
    lines, parts, sections = text.splitlines(keepends=True), [[]], []
    tail, fenced = "", False
    for i, line in enumerate(lines):
        fenced ^= line.lstrip().startswith("```")
        heading = None if fenced else HEADING.match(line)
        if heading:  # its title without closing #s (a regex backtracks on spaces)
            title = heading[1].strip()
            bare = title.rstrip("#")
            title = bare.rstrip() if not bare or bare[-1] in " \t" else title
            sections.append(Section(line.rstrip("\n"), title))
            parts.append([])
        elif sections and not fenced and TAIL.match(line):
            tail = "".join(lines[i:])
            break
        else:
            parts[-1].append(line)  # the head's, then each section's body
    for section, body in zip(sections, parts[1:], strict=True):
        section.body = "".join(body)
    return Template("\n".join(_html_comments("".join(parts[0]))), sections, tail)


def fill(template: Template, pieces: list[Piece]) -> str:
    """Each piece in the first section of a kind it prefers (else its own), the
    guidance kept where none went; in the tail every box unticked: each is a
    statement the author makes, never the tool (:func:`boxes` lists them)."""
    for piece in (p for p in pieces if p.text.strip()):
        home = next(
            (
                s
                for kind in piece.prefers
                for s in template.sections
                if kind in s.kinds
            ),
            None,
        )
        if home is None:
            title = piece.prefers[0].capitalize()
            home = Section(f"## {title}", title)
            template.sections.append(home)
        home.filled.append(piece.text.strip())
    out = [template.head] if template.head else []
    for section in template.sections:
        if section.filled:
            body = "\n\n".join(section.filled)
        else:
            body = section.body.strip()
        out.append(_closed(f"{section.heading}\n\n{body}".rstrip()))
    if template.left_out:
        out.append(f"_The checkout's PR template was {template.left_out}._")
    text = "\n\n".join(out) + "\n"
    if template.tail:
        text += "\n" + _closed(TICKED.sub(r"\1[ ]", template.tail))
    return text.rstrip() + "\n"


def _closed(chunk: str) -> str:
    """``chunk`` with an HTML comment it leaves open closed at its end."""
    return chunk + " -->" if chunk.rfind("<!--") > chunk.rfind("-->") else chunk


def boxes(template: Template) -> list[str]:
    """The text of each box of the template's checklist, in order."""
    return BOX.findall(template.tail)
