"""Add or remove a trailing boolean operand (``... or X``, ``... and X``),
keeping the expression's layout.

``A or B`` becomes ``A or B or C``. When the expression is parenthesised over
several lines, or its operands already stand one per line, the new operand gets
a line of its own, indented like the others, and a comment that trailed the old
last operand stays on that operand's line. Removing the operand is the exact
inverse, so apply then revert gives the original bytes back.
"""

from __future__ import annotations

import libcst as cst

# Left of a new `or`/`and`, these would bind differently without parentheses.
BINDS_LOOSER = (cst.IfExp, cst.Lambda, cst.NamedExpr)


def _operand_indent(expr: cst.BaseExpression) -> cst.SimpleWhitespace | None:
    """Indentation of the operands inside multi-line parentheses, if known."""
    if isinstance(expr, cst.BooleanOperation):
        ws = expr.operator.whitespace_before
        if isinstance(ws, cst.ParenthesizedWhitespace):
            return ws.last_line
    if expr.lpar and isinstance(
        expr.lpar[0].whitespace_after, cst.ParenthesizedWhitespace
    ):
        return expr.lpar[0].whitespace_after.last_line
    return None


def can_append(expr: cst.BaseExpression, operator: type[cst.BaseBooleanOp]) -> bool:
    """Whether ``expr <operator> X`` keeps ``expr``'s meaning without parentheses."""
    if expr.lpar:
        return True
    if isinstance(expr, BINDS_LOOSER):
        return False
    # `A or B and X` would bind X to B only.
    return not (
        operator is cst.And
        and isinstance(expr, cst.BooleanOperation)
        and isinstance(expr.operator, cst.Or)
    )


def append_operand(
    expr: cst.BaseExpression,
    operator: type[cst.BaseBooleanOp],
    operand: cst.BaseExpression,
) -> cst.BaseExpression:
    assert can_append(expr, operator)
    inner = expr.with_changes(lpar=[], rpar=[])
    before: cst.BaseParenthesizableWhitespace = cst.SimpleWhitespace(" ")
    rpar = list(expr.rpar)
    closing = rpar[-1].whitespace_before if rpar else None
    indent = _operand_indent(expr)
    if isinstance(closing, cst.ParenthesizedWhitespace) and indent is not None:
        # The new operand takes the line break (and comment) of the old last one.
        before = closing.with_changes(last_line=indent)
        rpar[-1] = rpar[-1].with_changes(
            whitespace_before=cst.ParenthesizedWhitespace(
                indent=closing.indent, last_line=closing.last_line
            )
        )
    elif closing is None and isinstance(
        getattr(expr, "operator", None), cst.BaseBooleanOp
    ):
        # Operands already one per line (inside someone else's parentheses):
        # the new one gets a line of its own too.
        if isinstance(expr.operator.whitespace_before, cst.ParenthesizedWhitespace):
            before = cst.ParenthesizedWhitespace(last_line=indent)
    return cst.BooleanOperation(
        left=inner,
        operator=operator(whitespace_before=before),
        right=operand,
        lpar=expr.lpar,
        rpar=rpar,
    )


def strip_operand(expr: cst.BooleanOperation) -> cst.BaseExpression:
    """The inverse of :func:`append_operand`: drop ``expr``'s last operand."""
    rpar = list(expr.rpar)
    before = expr.operator.whitespace_before
    closing = rpar[-1].whitespace_before if rpar else None
    if isinstance(before, cst.ParenthesizedWhitespace) and isinstance(
        closing, cst.ParenthesizedWhitespace
    ):
        rpar[-1] = rpar[-1].with_changes(
            whitespace_before=before.with_changes(last_line=closing.last_line)
        )
    return expr.left.with_changes(lpar=expr.lpar, rpar=rpar)
