"""The documents against the code they describe: ``docs/cli.md`` against the
command's argparse parser."""

import argparse
import re
from pathlib import Path

import pytest

from vllm_patch.cli import JOBS, build_parser

ROOT = Path(__file__).resolve().parents[1]
CLI_MD = ROOT / "docs" / "cli.md"
VERBS = ["list", "check", "diff", "apply", "revert", *JOBS]


def documented_commands() -> dict[str, str]:
    """Each command's synopsis in docs/cli.md's table (its first cell)."""
    rows = re.findall(r"^\| `vllm-patch (\w[\w-]*)([^`]*)`", CLI_MD.read_text(), re.M)
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
