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


# --- no import cycle ---------------------------------------------------------------


def module_name(path: Path, root: Path = ROOT) -> str:
    """``vllm_patch/bench/record.py``: ``vllm_patch.bench.record`` (a package: its
    folder's name)."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """The project's modules ``path`` imports, at module level or inside a
    function (a function-level import only hides a cycle until it runs):
    ``from a import b`` is the module ``a.b`` when there is one, else ``a``."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, a level up per dot
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            for alias in node.names:
                inner = f"{base}.{alias.name}"
                found.add(inner if inner in modules else base)
    return {m for m in found if m in modules and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's
    algorithm, iterative): each holds an import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                on_stack.add(target)
                work.append((target, iter(sorted(graph[target]))))
            elif target in on_stack:
                low[node] = min(low[node], index[target])
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    paths = [p for name in PACKAGES for p in (root / name).rglob("*.py")]
    modules = {module_name(p, root) for p in paths}
    return {module_name(p, root): imported(p, modules, root) for p in paths}


def test_no_module_imports_itself_through_others():
    """A cycle, even through an import inside a function, is a model two
    modules share: it goes into a leaf both import."""
    graph = import_graph()
    found = cycles(graph)
    said = [
        " <-> ".join(c)
        + ": "
        + "; ".join(f"{m} -> {', '.join(sorted(graph[m] & set(c)))}" for m in c)
        for c in found
    ]
    assert not found, "import cycles:\n" + "\n".join(said)
    assert "vllm_patch.bench.record" in graph["vllm_patch.bench.report"]
    # The evidence format is a leaf every part of bench imports.
    assert not {m for m in graph["vllm_patch.bench.record"] if "bench" in m}


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import f\n")
    (package / "b.py").write_text("def f():\n    from . import a\n")
    (package / "c.py").write_text("import pkg.a\n")
    paths = sorted(package.rglob("*.py"))
    modules = {module_name(p, tmp_path) for p in paths}
    graph = {
        module_name(p, tmp_path): imported(p, modules, tmp_path) for p in paths
    }
    assert graph["pkg.b"] == {"pkg.a"} and graph["pkg.c"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
