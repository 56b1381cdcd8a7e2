"""The checkout's own PR template, filled: vLLM's two real templates (v0.27.0
and v0.32.0, copied unchanged from the sdists) and the fallback layout."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from vllm_patch.upstream.template import (
    FALLBACK,
    TEMPLATE,
    Piece,
    boxes,
    fill,
    parse_template,
    read_template,
)

FIXTURES = Path(__file__).parent / "fixtures" / "upstream_files"
PIECES = [
    Piece(("purpose",), "WHAT"),
    Piece(("claims", "purpose"), "CLAIMS"),
    Piece(("plan",), "PLAN"),
    Piece(("result", "plan"), "RESULT"),
    Piece(("details", "purpose"), "DETAILS"),
]


def headings(text: str) -> list[str]:
    return re.findall(r"^## (.+)$", text, re.MULTILINE)


def section(text: str, title: str) -> str:
    return (
        text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0].split("\n---", 1)[0]
    )


@pytest.mark.parametrize(
    "release, placed",
    [
        pytest.param(
            "v0.32.0",
            {
                "Overview": ["WHAT"],
                "Claims": ["CLAIMS"],
                "Validation": ["PLAN", "RESULT"],
                "Details": ["DETAILS"],
            },
            id="v0.32.0 Overview/Claims/Validation/Details",
        ),
        pytest.param(
            "v0.27.0",
            {
                "Purpose": ["WHAT", "CLAIMS", "DETAILS"],
                "Test Plan": ["PLAN"],
                "Test Result": ["RESULT"],
            },
            id="v0.27.0 Purpose/Test Plan/Test Result",
        ),
    ],
)
def test_each_piece_goes_to_the_section_that_asks_for_it(tmp_path, release, placed):
    source = (FIXTURES / release / "PULL_REQUEST_TEMPLATE.md").read_text()
    (tmp_path / TEMPLATE).parent.mkdir(parents=True)
    (tmp_path / TEMPLATE).write_text(source)

    text = fill(read_template(tmp_path), PIECES)

    assert headings(text) == headings(source) == list(placed)
    for title, pieces in placed.items():
        assert section(text, title).split() == pieces, title
    # The checklist is the author's: kept as the template has it, unticked.
    checklist = source[source.index("\n---") :]
    assert text.endswith(checklist.lstrip("\n").rstrip() + "\n")
    assert "[x]" not in text.lower() and text.count("- [ ]") == source.count(
        "- [ ]"
    )
    assert text.startswith("<!-- markdownlint-disable -->\n")
    assert "PLEASE FILL IN" not in text  # an instruction to the author, not text


def test_a_checkout_without_a_template_gets_the_fallback_layout(tmp_path):
    template = read_template(tmp_path)
    assert template == parse_template(FALLBACK)
    text = fill(template, PIECES)
    assert headings(text) == ["Overview", "Claims", "Validation", "Details"]
    assert "[ ]" not in text


@pytest.mark.parametrize(
    "source, kinds",
    [
        pytest.param(
            "## Motivation\n", {"Motivation": ("purpose",)}, id="by heading"
        ),
        pytest.param(
            "## Notes\n<!-- How to test: steps to reproduce -->\n",
            {"Notes": ("plan",)},
            id="by its comment",
        ),
        pytest.param(
            "## Changelog\n<!-- user facing -->\n", {"Changelog": ()}, id="unknown"
        ),
        pytest.param(
            "## Purpose\n```\n## not a heading\n```\n",
            {"Purpose": ("purpose",)},
            id="code fence",
        ),
    ],
)
def test_sections_are_read_by_meaning(source, kinds):
    assert {s.title: s.kinds for s in parse_template(source).sections} == kinds


def test_a_section_nothing_fits_keeps_its_guidance_and_a_piece_without_a_home_gets_one():
    text = fill(
        parse_template("## Purpose\n\n## Changelog\n<!-- user facing -->\n"),
        [Piece(("purpose",), "WHAT"), Piece(("plan",), "PLAN")],
    )
    assert headings(text) == ["Purpose", "Changelog", "Plan"]
    assert "<!-- user facing -->" in section(text, "Changelog")
    assert section(text, "Plan").split() == ["PLAN"]


def test_ticked_boxes_of_a_template_are_unticked():
    text = fill(
        parse_template("## Purpose\n---\n- [x] done\n* [X] too\n"), PIECES[:1]
    )
    assert "- [ ] done" in text and "* [ ] too" in text


# Issue 42 item 3: a box is a statement the author signs; a planted one (or the
# release's own) stays as the author left it: unticked.
BOXES = {
    "a planted certification": "I certify that NO AI assistance was used, and I "
    "accept the CLA",
    "the release's Testing and Validation": "**Testing and Validation:** done",
    "the release's AI box": "AI assistance was used during the creation of this PR.",
    "the release's /pr-checklist": "I used vLLM's `/pr-checklist` skill.",
}


@pytest.mark.parametrize("box", list(BOXES.values()), ids=list(BOXES))
def test_no_box_is_ticked_by_the_tool(box):
    template = parse_template(f"## Purpose\n---\n- [ ] {box}\n- [x] {box}\n")
    text = fill(template, PIECES[:1])
    assert re.findall(r"^- \[(.)\] (.*)$", text, re.M) == [(" ", box)] * 2
    assert boxes(template) == [box, box]


@pytest.mark.parametrize(
    "source",
    [
        pytest.param(
            "## a" + " " * 16_000 + "x\n", id="a heading of 16,000 spaces"
        ),
        pytest.param("## P\n" + "<!--" * 4_000, id="4,000 unclosed comments"),
        pytest.param("## x\n" * 3_000, id="3,000 headings"),
        pytest.param("## P\n---\n" + "\n" * 16_000, id="a tail of blank lines"),
    ],
)
def test_a_hostile_template_within_the_bound_is_filled_in_linear_time(source):
    start = time.monotonic()
    text = fill(parse_template(source), PIECES)
    assert time.monotonic() - start < 1
    assert text.rfind("<!--") < text.rfind("-->") or "<!--" not in text


def test_an_unclosed_comment_is_closed_and_a_bad_template_left_out(tmp_path):
    text = fill(
        parse_template("## Purpose\n\n## Notes\n<!-- open\n\n## Test Plan\n"),
        PIECES,
    )
    assert "## Test Plan" in text and "<!-- open -->" in text
    (tmp_path / TEMPLATE).parent.mkdir(parents=True)
    (tmp_path / TEMPLATE).write_bytes(b"## Purpose\n\0\n")
    template = read_template(tmp_path)
    assert template.sections == parse_template(FALLBACK).sections
    assert "NUL" in template.left_out
    assert "\0" not in fill(template, PIECES) and "left out" in fill(
        template, PIECES
    )
