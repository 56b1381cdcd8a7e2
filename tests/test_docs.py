"""The documents against the code they describe: ``docs/cli.md`` against the
command's argparse parser, the vLLM releases where the forms change against
``patch.toml``."""

import argparse
import re
from pathlib import Path

import pytest
from packaging.version import Version

from patcher.patchset import all_patches
from vllm_patch.cli import JOBS, build_parser

ROOT = Path(__file__).resolve().parents[1]
CLI_MD = ROOT / "docs" / "cli.md"
VERBS = ["list", "check", "diff", "apply", "revert", *JOBS]


def documented_commands() -> dict[str, str]:
    """Each command's synopsis in docs/cli.md's table (its first cell)."""
    rows = re.findall(
        r"^\| `vllm-patch (\w[\w-]*)([^`]*)`", CLI_MD.read_text(), re.M
    )
    return {name: synopsis for name, synopsis in rows}


def options(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string the parser takes, but ``--help``."""
    return [
        option
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction)
        for option in action.option_strings
        if option.startswith("--")
    ]


def subparser(verb: str) -> argparse.ArgumentParser:
    """The verb's parser as the command builds it (its job imported)."""
    parser = build_parser([verb])
    (commands,) = [
        a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
    ]
    return commands.choices[verb]


@pytest.mark.parametrize("verb", VERBS)
def test_every_option_of_the_command_is_in_docs_cli_md(verb):
    synopsis = documented_commands().get(verb)
    assert synopsis is not None, f"docs/cli.md has no row for `vllm-patch {verb}`"
    taken = options(subparser(verb))
    missing = [o for o in taken if not re.search(rf"{o}(?![\w-])", synopsis)]
    assert missing == [], f"`vllm-patch {verb}` options not in docs/cli.md"
    unknown = set(re.findall(r"--[\w-]+", synopsis)) - set(taken)
    assert unknown == set(), f"docs/cli.md names options `{verb}` lacks"


def test_the_commands_own_options_are_in_docs_cli_md():
    parser = build_parser([])
    for option in options(parser):
        assert f"`vllm-patch {option}`" in CLI_MD.read_text(), option
    assert set(documented_commands()) == set(VERBS)  # a row per command, no other


# --- the vLLM releases where the forms change, from patch.toml ---------------

FORM_WORDS = re.compile(r"\bIR\b|cpu_fused_norms|rms_norm_forward_cpu|forward_cpu")
RANGE = re.compile(r"\b(0\.\d+) ?- ?(0\.\d+)\b")
POINT = re.compile(r"\b(?:before|from) (0\.\d+)\b|\b(0\.\d+)(?: on\b|\+)")
PAGES = [
    ROOT / "README.md",
    ROOT / "ARCHITECTURE.md",
    *(ROOT / "docs").glob("*.md"),
]


def bound(specifiers, operator: str) -> Version:
    (found,) = [s.version for s in specifiers if s.operator == operator]
    return Version(found)


def minor(version: Version, step: int = 0) -> str:
    return f"{version.major}.{version.minor + step}"


def boundaries() -> tuple[set[str], set[str]]:
    """(the form ranges the docs may write, the releases they may name as a
    boundary), from the two patches' ``vllm`` and ``default``."""
    patches = {p.name: p for p in all_patches()}
    custom_op = bound(patches["rms_norm_forward_cpu"].versions, ">=")  # 0.13
    ir = patches["cpu_fused_norms"]
    ir_from = bound(ir.versions, ">=")  # 0.20
    ir_until = bound(ir.default, "<")  # 0.33
    ranges = {
        f"{minor(custom_op)} - {minor(ir_from, -1)}",
        f"{minor(ir_from)} - {minor(ir_until, -1)}",
    }
    points = {minor(v) for v in (custom_op, ir_from, ir_until)}
    return ranges, points | {minor(ir_from, -1), minor(ir_until, -1)}


def test_the_form_boundaries_in_the_docs_are_patch_tomls():
    """Where a line speaks of a form (IR, the two patches), every range and
    every "from / before / on" release it names is one patch.toml gives."""
    ranges, points = boundaries()
    readme = (ROOT / "README.md").read_text()
    for row in (*sorted(ranges), f"{max(points)} on"):
        assert f"| {row} |" in readme  # the table of the two forms
    checked, wrong = 0, []
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if not FORM_WORDS.search(line):
                continue
            for start, end in RANGE.findall(line):
                checked += 1
                if f"{start} - {end}" not in ranges:
                    wrong.append(f"{page.name}:{number}: {start} - {end}")
            for found in POINT.findall(line):
                checked += 1
                if (found[0] or found[1]) not in points:
                    wrong.append(f"{page.name}:{number}: {found[0] or found[1]}")
    assert checked >= 8 and wrong == [], (ranges, points)
