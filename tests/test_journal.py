"""A hostile intent record (``.vllm-patch-journal.json``) left in a tree: every
command refuses it with one message (exit 3), never blocks, never reads more
than the record's bound, never recurses out, and changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import make_tree, snapshot

from patcher.files import MAX_RECORD_BYTES
from patcher.journal import JOURNAL
from vllm_patch.cli import main


def text(data: str) -> Callable[[Path], None]:
    return lambda path: path.write_text(data)


CASES = [
    pytest.param(lambda p: p.symlink_to("/dev/zero"), ["a symbolic link"],
                 id="link-to-dev-zero"),
    pytest.param(lambda p: p.mkdir(), ["not a regular file", "a directory"],
                 id="directory"),
    pytest.param(text("[" * 200_000 + "]" * 200_000), ["JSON nested too deep"],
                 id="nested-arrays"),
    pytest.param(text('{"a":' * 100_000 + "1" + "}" * 100_000),
                 ["JSON nested too deep"], id="nested-objects"),
    pytest.param(text(" " * MAX_RECORD_BYTES + "{}"), ["file too large"],
                 id="over-the-bound"),
    pytest.param(text('{"operation": 1}'), ["another shape"], id="wrong-shape"),
    pytest.param(lambda p: p.write_bytes(b'{"operation": "\xff"}'), ["invalid"],
                 id="not-utf8"),
]  # fmt: skip


VERBS = ["check", "diff", "apply", "revert"]


def said_once(err: str, tree: Path, says: list[str]) -> None:
    assert "Traceback" not in err
    assert err.count("vllm-patch: error:") == 1
    assert str(tree / JOURNAL) in err
    assert all(s in err for s in says), err


@pytest.mark.parametrize("plant,says", CASES)
@pytest.mark.parametrize("verb", VERBS)
def test_a_hostile_record_is_one_message(tmp_path, capsys, verb, plant, says):
    tree = make_tree(tmp_path / "tree", "installed")
    plant(tree / JOURNAL)
    before = snapshot(tmp_path)
    assert main([verb, "--vllm", str(tree)]) == 3
    said_once(capsys.readouterr().err, tree, says)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("verb", VERBS)
def test_a_fifo_record_does_not_block(tmp_path, verb) -> None:
    tree = make_tree(tmp_path / "tree", "installed")
    os.mkfifo(tree / JOURNAL)
    before = snapshot(tmp_path)
    # A process of its own, so that a command that blocks fails the test (the
    # timeout) instead of hanging it.
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_patch", verb, "--vllm", str(tree)],
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert proc.returncode == 3, proc.stderr
    said_once(proc.stderr, tree, ["not a regular file", "FIFO"])
    assert snapshot(tmp_path) == before
