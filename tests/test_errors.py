"""Messages name files as they can be printed: a tree whose path is not UTF-8
(a byte ``\\xff`` in a folder name) is shown with ``\\xff``, under a UTF-8
output encoding too, never a ``UnicodeEncodeError``."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest
from conftest import VLLM_C, make_tree

from patcher.errors import PatchError, printable
from vllm_patch.cli import main

NAME = os.fsdecode(b"tr\xffee")


def test_shown_escapes_only_what_is_not_utf8() -> None:
    assert printable(Path("/a") / NAME / "é.py") == "/a/tr\\xffee/é.py"
    assert PatchError("x", path=str(Path(NAME))).path == "tr\\xffee"


@pytest.mark.parametrize(
    "argv,plant,code",
    [
        pytest.param(["check"], None, 1, id="check-report"),
        pytest.param(["check", "--json"], None, 1, id="check-json"),
        pytest.param(["apply"], VLLM_C, 3, id="apply-error"),
        pytest.param(["diff"], VLLM_C, 3, id="diff-error"),
        pytest.param(["revert"], VLLM_C, 3, id="revert-error"),
    ],
)
def test_a_non_utf8_tree_path_prints(tmp_path, monkeypatch, argv, plant, code):
    tree = make_tree(tmp_path / NAME)
    if plant:
        (tree / plant).write_text("{not json")
    # What PYTHONIOENCODING=utf-8 gives: strict UTF-8 streams.
    out, err = (io.TextIOWrapper(io.BytesIO(), encoding="utf-8") for _ in "12")
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    assert main([*argv, "--vllm", str(tree)]) == code
    said = b""
    for stream in (out, err):
        stream.flush()
        said += stream.buffer.getvalue()
    assert b"tr\\xffee" in said or b"tr\\udcffee" in said  # JSON escapes it itself
    assert (tree / VLLM_C).is_file()
