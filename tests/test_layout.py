"""The shape of the code: no function outside ``tests/`` has more than 60 lines
of code (a longer one is split into named steps over a dataclass). Docstrings,
comments and blank lines do not count: the reasons are never what gets cut."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 60
# The project's code: its packages and the noxfile (not tests/, and not the
# virtual environments a checkout may hold).
PACKAGES = ("patcher", "patches", "vllm_patch", "compat_matrix")
DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def sources() -> list[Path]:
    found = [p for name in PACKAGES for p in (ROOT / name).rglob("*.py")]
    return sorted([*found, ROOT / "noxfile.py"])


def docstring_lines(node: ast.AST) -> set[int]:
    """The line numbers of the docstrings in ``node`` (its own, and those of
    the functions and classes inside it)."""
    lines = set()
    for inner in ast.walk(node):
        if not isinstance(inner, DEFINITIONS) or not inner.body:
            continue
        first = inner.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
            if isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def code_lines(node: ast.AST, text: list[str]) -> int:
    """Lines of ``node`` that hold code: not a docstring, comment or blank."""
    docs = docstring_lines(node)
    return sum(
        1
        for number in range(node.lineno, node.end_lineno + 1)
        if number not in docs
        and text[number - 1].strip()
        and not text[number - 1].lstrip().startswith("#")
    )


def long_functions(path: Path, root: Path = ROOT) -> dict[str, int]:
    """``file::function`` of every function in ``path`` with over ``MAX_LINES``
    lines of code (its ``def`` line included), with that count."""
    rel = path.relative_to(root).as_posix()
    source = path.read_text("utf-8")
    text = source.splitlines()
    found = {}
    for node in ast.walk(ast.parse(source, filename=rel)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            count = code_lines(node, text)
            if count > MAX_LINES:
                found[f"{rel}::{node.name}"] = count
    return found


def test_no_function_has_more_than_60_lines_of_code():
    over = {k: v for p in sources() for k, v in long_functions(p).items()}
    assert not over, f"functions over {MAX_LINES} lines of code: {over}"
    assert len(sources()) > 50  # it read the project


DOC = '    """A docstring\n\n    of four lines.\n    """\n'
COMMENT = "    # why\n\n"


@pytest.mark.parametrize(
    "body, expected",
    [
        pytest.param("    pass\n" * 59, {}, id="60 lines"),
        pytest.param("    pass\n" * 60, {"m.py::f": 61}, id="61 lines"),
        pytest.param(DOC + "    pass\n" * 59, {}, id="60 lines and a docstring"),
        pytest.param(COMMENT * 10 + "    pass\n" * 59, {}, id="and comments"),
        pytest.param(
            DOC + "    pass\n" * 60, {"m.py::f": 61}, id="61 lines and a docstring"
        ),
        pytest.param(
            "    def g():\n"
            + DOC.replace("    ", "        ")
            + "        pass\n" * 58,
            {},
            id="an inner function's docstring",
        ),
    ],
)
def test_the_length_counts_code_not_docstrings_or_comments(
    tmp_path, body, expected
):
    source = tmp_path / "m.py"
    source.write_text("def f():\n" + body)
    assert long_functions(source, tmp_path) == expected
