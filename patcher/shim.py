"""Compatibility shims: a module file that only makes its name an alias of a
module elsewhere (``sys.modules[__name__] = importlib.import_module("x.y")``).
A reorganised vLLM leaves such files at the old paths; the patch edits the
module they point to, in the same tree.
"""

from __future__ import annotations

import ast

from patcher.errors import PatchError
from patcher.tree import VllmTree

MAX_HOPS = 8  # a shim pointing at a shim, and so on; more is a loop


def shim_target(source: str) -> str | None:
    """The module ``source`` aliases itself to, if it is a shim:
    ``sys.modules[__name__] = importlib.import_module("x")`` (or
    ``import_module("x")``), or ``= m`` after ``import x as m`` /
    ``from x import y as m`` or ``m = importlib.import_module("x")`` at module
    level."""
    if "sys.modules" not in source:
        return None  # the cheap answer for every file that is not a shim
    try:
        module = ast.parse(source)
    except (SyntaxError, ValueError):
        return None  # the codemod reports it, with its position
    imported: dict[str, str] = {}
    for stmt in module.body:
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.asname:
                    imported[alias.asname] = alias.name
        elif isinstance(stmt, ast.ImportFrom) and stmt.module and not stmt.level:
            for alias in stmt.names:
                imported[alias.asname or alias.name] = f"{stmt.module}.{alias.name}"
        elif isinstance(stmt, ast.Assign) and any(map(_is_own_entry, stmt.targets)):
            return _module_named(stmt.value, imported)
        elif isinstance(stmt, ast.Assign):
            _bind(stmt, imported)
    return None


def _bind(stmt: ast.Assign, imported: dict[str, str]) -> None:
    """``m = importlib.import_module("x")`` binds ``m`` to module ``x``; any
    other assignment to a name unbinds it."""
    module = _module_named(stmt.value, {})
    for target in stmt.targets:
        if isinstance(target, ast.Name):
            if module is None:
                imported.pop(target.id, None)
            else:
                imported[target.id] = module


def _is_own_entry(target: ast.expr) -> bool:
    """``sys.modules[__name__]``."""
    return (
        isinstance(target, ast.Subscript)
        and ast.unparse(target.value) == "sys.modules"
        and ast.unparse(target.slice) == "__name__"
    )


def _module_named(value: ast.expr, imported: dict[str, str]) -> str | None:
    if isinstance(value, ast.Name):
        return imported.get(value.id)
    if (
        isinstance(value, ast.Call)
        and ast.unparse(value.func) in ("importlib.import_module", "import_module")
        and value.args
        and isinstance(value.args[0], ast.Constant)
        and isinstance(value.args[0].value, str)
    ):
        return value.args[0].value
    return None


def module_files(name: str) -> tuple[str, str]:
    """Where module ``name`` lives in a tree: ``x/y.py`` or ``x/y/__init__.py``."""
    base = name.replace(".", "/")
    return f"{base}.py", f"{base}/__init__.py"


def follow(tree: VllmTree, relpath: str) -> str:
    """The file that holds the code of ``relpath``: itself, or the module its
    shim points to (exit 3, naming that module, when it is not in the tree)."""
    seen = [relpath]
    while tree.exists(seen[-1]) and len(seen) <= MAX_HOPS:
        target = shim_target(tree.read_text(seen[-1]))
        if target is None:
            return seen[-1]
        found = [f for f in module_files(target) if tree.exists(f)]
        if not found:
            raise PatchError(
                f"a compatibility shim for module {target}, which is not in this tree",
                path=tree.display(seen[-1]),
                looked_for=f"{target} as {' or '.join(module_files(target))}",
                found="no such file",
            )
        seen.append(found[0])
    if len(seen) > MAX_HOPS:
        raise PatchError(
            "compatibility shims that do not end in a module",
            path=tree.display(relpath),
            found=" -> ".join(seen),
        )
    return seen[-1]
