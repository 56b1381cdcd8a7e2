"""vLLM's ``ruff format`` layout (88 columns, 4-space indents) of the few shapes
of statement the IR codemods write, so that no formatter runs at apply time. The
tests hold every line they write to the pinned ruff on every tree they patch."""

import libcst as cst

from patcher.codemod import source

LINE_LENGTH = 88  # vLLM's pyproject.toml [tool.ruff], 0.20 - 0.33
INDENT = "    "


def fits(code: str, indent: int = 0) -> bool:
    """Whether ``code`` (one line) fits the line ``indent`` columns in."""
    return indent + len(code) <= LINE_LENGTH


def broken(head: str, inner: list[str], tail: str, indent: str = "") -> str:
    """``head``, the ``inner`` lines one indent in, then ``tail``: a statement
    ``indent`` in (its first line's left to the caller), broken over the
    brackets it ends in, as ruff breaks one that does not fit."""
    lines = [head, *(indent + INDENT + line for line in inner), indent + tail]
    return "\n".join(lines)


class _OneLine(cst.CSTTransformer):
    """A line break inside brackets as one space;
    none after ``(`` or before ``)``."""

    def leave_ParenthesizedWhitespace(self, original, updated):
        return cst.SimpleWhitespace(" ")

    def leave_LeftParen(self, original, updated):
        return updated.with_changes(whitespace_after=cst.SimpleWhitespace(""))

    def leave_RightParen(self, original, updated):
        return updated.with_changes(whitespace_before=cst.SimpleWhitespace(""))


def one_line(node: cst.CSTNode) -> str:
    """``node``'s code joined on one line, as ruff joins what fits."""
    return source(node.visit(_OneLine()))


def operands(expr: cst.BooleanOperation) -> list[tuple[str, cst.BaseExpression]]:
    """``a and b and c`` as ``[("", a), ("and ", b), ("and ", c)]``: the chain of
    one operator, which ruff breaks before each operator."""
    kind = type(expr.operator)
    chain = []
    while isinstance(expr, cst.BooleanOperation) and isinstance(
        expr.operator, kind
    ):
        chain.append((f"{source(expr.operator)} ", expr.right))
        expr = expr.left
        if expr.lpar:  # parenthesized: one operand
            break
    chain.append(("", expr))
    return chain[::-1]


def boolean_lines(expr: cst.BaseExpression, indent: int) -> list[str]:
    """``expr`` inside brackets, its lines ``indent`` columns in: one line if it
    fits, else an operand a line led by its operator, a parenthesized operand
    that does not fit opened the same way one indent further in."""
    if fits(one_line(expr), indent) or not isinstance(expr, cst.BooleanOperation):
        return [one_line(expr)]
    lines = []
    for lead, operand in operands(expr):
        code = lead + one_line(operand)
        if fits(code, indent) or not operand.lpar:
            lines.append(code)
            continue
        inner = operand.with_changes(lpar=[], rpar=[])
        nested = boolean_lines(inner, indent + len(INDENT))
        lines += [f"{lead}(", *(INDENT + line for line in nested), ")"]
    return lines


def lambda_statement(target: str, function: cst.Lambda) -> str:
    """``target = lambda ...: body`` on one line if it fits; else the body in
    parentheses (ruff 0.17 moves them there from around the lambda), broken."""
    body = function.body.with_changes(lpar=[], rpar=[])
    line = f"{target} = lambda {one_line(function.params)}: {one_line(body)}"
    if fits(line):
        return line
    head = f"{target} = lambda {one_line(function.params)}: ("
    return broken(head, boolean_lines(body, len(INDENT)), ")")
