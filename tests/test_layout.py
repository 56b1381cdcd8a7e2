"""The shape of the code: no function outside ``tests/`` is longer than 60
lines (a longer one is split into named steps over a dataclass)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 60
# The project's code: its packages and the noxfile (not tests/, and not the
# virtual environments a checkout may hold).
PACKAGES = ("patcher", "patches", "vllm_patch", "compat_matrix")


def sources() -> list[Path]:
    found = [p for name in PACKAGES for p in (ROOT / name).rglob("*.py")]
    return sorted([*found, ROOT / "noxfile.py"])


def long_functions(path: Path, root: Path = ROOT) -> dict[str, int]:
    """``file::function`` of every function in ``path`` over ``MAX_LINES``
    lines (from its ``def`` line to its last, docstring included), with its
    length."""
    rel = path.relative_to(root).as_posix()
    tree = ast.parse(path.read_text("utf-8"), filename=rel)
    return {
        f"{rel}::{node.name}": node.end_lineno - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_LINES
    }


def test_no_function_is_longer_than_60_lines():
    over = {k: v for p in sources() for k, v in long_functions(p).items()}
    assert not over, f"functions over {MAX_LINES} lines: {over}"


@pytest.mark.parametrize(
    "body, expected",
    [
        pytest.param("    pass\n" * 59, {}, id="60-lines"),
        pytest.param("    pass\n" * 60, {"m.py::f": 61}, id="61-lines"),
    ],
)
def test_the_length_counts_the_def_line_and_the_body(tmp_path, body, expected):
    source = tmp_path / "m.py"
    source.write_text("def f():\n" + body)
    assert long_functions(source, tmp_path) == expected
