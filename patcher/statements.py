"""Module-level statements (and the decorators of module-level definitions) as
the units an edit lays out: which of them hold given nodes, reading and
replacing one by position, and inserting or removing a statement with the
blank lines around it given back exactly."""

from __future__ import annotations

import libcst as cst

Place = tuple[int, "int | None"]
"""Index in the module's body, and of the decorator there (None: the statement)."""


class _Contains(cst.CSTVisitor):
    def __init__(self, targets) -> None:
        self.targets, self.found = targets, False

    def on_visit(self, node: cst.CSTNode) -> bool:
        self.found = self.found or node in self.targets
        return not self.found


def units_holding(tree: cst.Module, targets) -> list[Place]:
    """Where the ``targets`` (nodes of ``tree``) sit: in which decorator, or else
    in which statement."""
    units = []
    for i, stmt in enumerate(tree.body):
        decorators = getattr(stmt, "decorators", ())
        held = [j for j, d in enumerate(decorators) if holds(d, targets)]
        if held:
            units += [(i, j) for j in held]
        elif holds(stmt, targets):
            units.append((i, None))
    return units


def unit_at(tree: cst.Module, at: Place) -> cst.CSTNode:
    stmt = tree.body[at[0]]
    return stmt if at[1] is None else stmt.decorators[at[1]]


def with_unit(tree: cst.Module, at: Place, node: cst.CSTNode) -> cst.Module:
    body = list(tree.body)
    if at[1] is None:
        body[at[0]] = node
    else:
        decorators = list(body[at[0]].decorators)
        decorators[at[1]] = node
        body[at[0]] = body[at[0]].with_changes(decorators=decorators)
    return tree.with_changes(body=body)


def holds(node: cst.CSTNode, targets) -> bool:
    """Whether any of ``targets`` is ``node`` or inside it."""
    visitor = _Contains(targets)
    node.visit(visitor)
    return visitor.found


def insert_before(tree: cst.Module, at: int, *statements) -> cst.Module:
    """``statements`` before ``tree.body[at]``, the first taking the blank lines
    above it (the others keep their own); that statement keeps its comments and
    gets the two blank lines ruff wants."""
    body = list(tree.body)
    after = body[at]
    lines = list(after.leading_lines)
    blank = 0
    while blank < len(lines) and lines[blank].comment is None:
        blank += 1
    body[at : at + 1] = [
        statements[0].with_changes(leading_lines=lines[:blank]),
        *statements[1:],
        after.with_changes(leading_lines=[cst.EmptyLine()] * 2 + lines[blank:]),
    ]
    return tree.with_changes(body=body)


def remove_at(tree: cst.Module, at: int, count: int = 1) -> cst.Module:
    """The inverse of :func:`insert_before` (of ``count`` statements)."""
    body = list(tree.body)
    removed, after = body[at], body[at + count]
    body[at : at + count + 1] = [
        after.with_changes(
            leading_lines=[*removed.leading_lines, *after.leading_lines[2:]]
        )
    ]
    return tree.with_changes(body=body)


def insert_at(tree: cst.Module, at: int, *statements) -> cst.Module:
    """``statements`` at ``tree.body[at]``, right below the statement before it
    (no blank line between); the statements after keep theirs."""
    body = list(tree.body)
    body[at:at] = [s.with_changes(leading_lines=[]) for s in statements]
    return tree.with_changes(body=body)


def drop_at(tree: cst.Module, at: int, count: int = 1) -> cst.Module:
    """The inverse of :func:`insert_at`."""
    body = list(tree.body)
    del body[at : at + count]
    return tree.with_changes(body=body)
