"""The README's contract: a quick start that opens with the set-up and the test
command, links that lead somewhere, no measured figure typed into prose (figures
live in the generated reports), and the exit-code table equal to ``ExitCode``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from patcher.errors import ExitCode

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted([README, ROOT / "ARCHITECTURE.md", *(ROOT / "docs").glob("*.md")])
MAX_LINES = 150
OPENING = 40  # the set-up and the test command come within these lines

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A number with the unit of a measurement: a time, a size, a speed, a ratio.
FIGURE = re.compile(
    r"\b\d[\d,.]*\s?(?:CPU-)?(?:s|ms|us|µs|min|minutes?|hours?|[KMG]i?B|tok/s|x)(?![\w-])"
)


def _prose(text: str) -> str:
    """The text outside fenced code blocks (commands may carry numbers)."""
    return FENCE.sub("", text)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    words = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return words.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#+ (.+)$", _prose(page.read_text("utf-8")), re.M)
    return {_anchor(h) for h in headings}


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_the_readme_is_a_quick_start() -> None:
    lines = README.read_text("utf-8").splitlines()
    assert len(lines) <= MAX_LINES


@pytest.mark.parametrize(
    "line",
    [
        pytest.param("python -m pip install -e '.[cpu]'", id="user set-up"),
        pytest.param("vllm-patch doctor --fix", id="doctor"),
        pytest.param("vllm-patch apply", id="the main job"),
        pytest.param(
            "python -m pip install -e '.[pr]' --group test", id="dev set-up"
        ),
        pytest.param("pytest", id="fast tier"),
        pytest.param("nox -s tests", id="both tiers"),
    ],
)
def test_the_opening_shows(line: str) -> None:
    opening = README.read_text("utf-8").splitlines()[:OPENING]
    commands = [row.split("#")[0].strip() for row in opening]
    assert line in commands, f"not a command line in README.md's first {OPENING}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_leads_somewhere(page: Path) -> None:
    broken = []
    for target in LINK.findall(_prose(page.read_text("utf-8"))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{_name(page)}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_no_measured_figure_in_prose(page: Path) -> None:
    """Figures go stale: the reports hold them, the pages link the reports."""
    assert FIGURE.findall(_prose(page.read_text("utf-8"))) == []


@pytest.mark.parametrize(
    "text, figures",
    [
        pytest.param("5.8 CPU-minutes, 28 min", ["5.8 CPU-minutes", "28 min"]),
        pytest.param("3.6 GB, and 0.84 GB of wheels", ["3.6 GB", "0.84 GB"]),
        pytest.param("fused gave 1.16x eager", ["1.16x"]),
        pytest.param("12.6 tok/s in 2.1 s", ["12.6 tok/s", "2.1 s"]),
        pytest.param("vLLM 0.32.0, 88 columns, 100 kills, x86-64", []),
        pytest.param("a multiple of 8; `--threads 1,2`; over 90%", []),
    ],
)
def test_what_counts_as_a_figure(text: str, figures: list[str]) -> None:
    assert FIGURE.findall(text) == figures


def test_the_exit_code_table_is_exit_code() -> None:
    assert ExitCode.table() in (ROOT / "docs" / "cli.md").read_text("utf-8")
