"""Mark the "vllm_c" RMSNorm impls (vLLM 0.20-0.32) supported on CPU where they
match native: the norms' gate gains ``or IS_CPU`` (in place where only the norms
use it, else a new ``RMS_NORM_DEVICE``), each ``supports_args`` the rule's checks
(``patches/cpu_norm_rule.py``, through ``patches/cpu_norm_source.py``)."""

import ast
import re
import textwrap
from typing import NamedTuple

import libcst as cst

from patcher.codemod import TreeCodemod, names, source
from patches import cpu_norm_source as rule
from patches.cpu_fused_norms.identity import OPS, UPSTREAM_PROVIDER
from patches.cpu_fused_norms.layout import lambda_statement

GATE = "GPGPU_DEVICE"
NORM_GATE = "RMS_NORM_DEVICE"
IS_CPU = "IS_CPU"
IS_CPU_LINE = f"{IS_CPU} = current_platform.is_cpu()"
FUNCTION = rule.FUNCTIONS[0]
DTYPES = "CPU_DTYPES"
# Once per process, at import: a CPU worker's threads are set by then (its
# binding's OMP_NUM_THREADS at start-up; read in 0.32.0). The lines as vLLM's
# file holds them, in its 88 columns.
DTYPES_LINES = (
    f"{DTYPES} = () if {rule.FUNCTIONS[1]}() else {FUNCTION}()",
    '"""The dtypes in which the CPU kernels match native here, once per process."""',  # noqa: E501
)
# How many leading parameters of each norm's supports_args are its input tensors.
TENSORS = {"rms_norm": 1, "fused_add_rms_norm": 2}


class Norm(NamedTuple):
    op: str
    at: int
    gate: cst.Name
    check_at: int
    check: cst.Lambda
    guard: str


def norm_impls(tree: cst.Module) -> dict[str, tuple[int, cst.Call]]:
    """op -> (its statement's index, its ``register_impl("vllm_c", ...)`` call)."""
    found = {}
    for i, stmt in enumerate(tree.body):
        for decorator in getattr(stmt, "decorators", ()):
            call = decorator.decorator
            if not isinstance(call, cst.Call) or not call.args:
                continue
            op = re.fullmatch(r"ir\.ops\.(\w+)\.register_impl", source(call.func))
            provider = getattr(call.args[0].value, "evaluated_value", None)
            if op and op[1] in OPS and provider == UPSTREAM_PROVIDER:
                found[op[1]] = (i, call)
    return found


def _assignments(tree: cst.Module) -> dict:
    """Target code -> (index, value) of the first module-level ``target = ...``."""
    found: dict = {}
    for i, stmt in enumerate(tree.body):
        small = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) else None
        if isinstance(small, cst.Assign) and len(small.targets) == 1:
            found.setdefault(source(small.targets[0].target), (i, small.value))
    return found


def _assigned(tree: cst.Module, at: int, value: cst.BaseExpression):
    return tree.body[at].deep_replace(tree.body[at].body[0].value, value)


def meaning(code: str) -> str:
    return ast.dump(ast.parse(textwrap.dedent(code.lstrip("\r\n"))))


def _suffixed(expr: cst.BaseExpression, operator: type, code: str, on: bool):
    """``expr`` ending in ``<operator> code`` (``on``) or not, in its outer
    parentheses; None when it is so already, however laid out."""
    there = isinstance(expr, cst.BooleanOperation) and isinstance(
        expr.operator, operator
    )
    ends_in_code = there and meaning(source(expr.right)) == meaning(code)
    if expr is None or ends_in_code == on:
        return None
    if not on:
        return expr.left.with_changes(lpar=expr.lpar, rpar=expr.rpar)
    inner = expr.with_changes(lpar=[], rpar=[])
    if not there:
        inner = inner.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    operand = cst.parse_expression(code)
    return cst.BooleanOperation(inner, operator(), operand, expr.lpar, expr.rpar)


def _statement(code: str) -> cst.BaseStatement:
    """``code`` (laid out as ruff would) as a statement; its line ends, parsed
    as the default ones, are the tree's wherever it goes."""
    return cst.parse_statement(code + "\n")


def _in_newlines(stmt: cst.BaseStatement, tree: cst.Module) -> cst.BaseStatement:
    """``stmt`` (parsed from LF-ended lines) in the tree's line ends, its
    strings' line breaks too, as ruff writes a file's."""
    code = cst.Module([]).code_for_node(stmt).replace("\n", tree.default_newline)
    return cst.parse_statement(code, tree.config_for_parsing)


def _lambda(tree: cst.Module, at: int, check: cst.Lambda) -> cst.BaseStatement:
    """Statement ``at`` (``name = lambda ...``) with ``check``, laid out anew."""
    target = source(tree.body[at].body[0].targets[0].target)
    own = _statement(lambda_statement(target, check))
    return own.with_changes(leading_lines=tree.body[at].leading_lines)


def _spaced(
    previous: cst.BaseStatement, stmt: cst.BaseStatement
) -> cst.BaseStatement:
    """``stmt`` after ``previous`` at module level: two blank lines on either side
    of a def or class, as ruff (and PEP 8) puts them."""
    defs = (cst.FunctionDef, cst.ClassDef)
    lines = stmt.leading_lines
    if not isinstance(previous, defs) and not isinstance(stmt, defs):
        return stmt
    if len(lines) >= 2 or any(line.comment for line in lines):
        return stmt
    return stmt.with_changes(leading_lines=[cst.EmptyLine(indent=False)] * 2)


def _rebuild(tree: cst.Module, new: dict, before: dict) -> cst.Module:
    """``tree`` with ``new[i]`` for statement i (None: out), ``before[i]`` before
    it; each written statement and the one after it spaced as ruff spaces them."""
    body, written = [], set()
    for i, stmt in enumerate(tree.body):
        written.update(range(len(body), len(body) + len(before.get(i, ()))))
        body += before.get(i, ())
        if new.get(i, stmt) is not None:
            if i in new:
                written.add(len(body))
            body.append(new.get(i, stmt))
    for at in sorted(written | {i + 1 for i in written}):
        if 0 < at < len(body):
            body[at] = _spaced(body[at - 1], body[at])
    return tree.with_changes(body=body)


class EnableVllmCOnCpu(TreeCodemod):
    DESCRIPTION = 'Run the "vllm_c" RMSNorm kernels on CPU where they match native.'

    ON = True  # the change; DisableVllmCOnCpu's False: its inverse

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        used = names(tree)
        for name in ("current_platform", "torch") if self.ON else ():
            if not used[name]:
                raise self.shape_error(f"{name} imported", "none")
        norms, new, before = self.norms(tree), {}, {}
        cpu = _assignments(tree).get(IS_CPU, (None,))[0]
        if self.ON and cpu is not None and source(tree.body[cpu]) != IS_CPU_LINE:
            raise self.shape_error(
                f"{IS_CPU} unassigned, or `{IS_CPU_LINE}`", source(tree.body[cpu])
            )
        for n in norms:
            body = _suffixed(n.check.body, cst.And, n.guard, self.ON)
            if body is not None:
                check = n.check.with_changes(body=body)
                new[n.check_at] = _lambda(tree, n.check_at, check)
                said = (
                    f"gains `and {n.guard}`" if self.ON else "loses its CPU checks"
                )
                self.record(f"the {n.op} impl's `supports_args` {said}")
        self.gate(tree, norms, used, new, before)
        if not new and not before:
            return tree
        return self.finish(tree, norms, cpu, used, new, before)

    def norms(self, tree: cst.Module) -> list[Norm]:
        found, assigned = [], _assignments(tree)
        for op, (at, call) in norm_impls(tree).items():
            kw = {a.keyword.value: a.value for a in call.args if a.keyword}
            for key in ("supported", "supports_args"):
                if not isinstance(kw.get(key), cst.Name):
                    shown = source(kw[key]) if key in kw else "none"
                    raise self.shape_error(
                        f"{key}=NAME in the vllm_c {op} impl", shown
                    )
            check_at, check = assigned.get(kw["supports_args"].value, (None, None))
            if not isinstance(check, cst.Lambda):
                raise self.shape_error(
                    f"{op}'s supports_args a module-level lambda",
                    source(kw["supports_args"]),
                )
            p = [x.name.value for x in check.params.params]
            if len(p) < TENSORS[op] + 1:
                raise self.shape_error(
                    f"{op}'s supports_args taking its input tensors, "
                    "then the weight",
                    source(check.params),
                )
            residual = p[1] if TENSORS[op] > 1 else None
            checks = rule.call_checks(p[0], p[TENSORS[op]], DTYPES, residual)
            guard = f"(not {IS_CPU} or ({checks}))"
            found.append(Norm(op, at, kw["supported"], check_at, check, guard))
        if not found:
            raise self.shape_error(
                '@ir.ops.rms_norm.register_impl("vllm_c", ...)', "no such impl"
            )
        gates = {n.gate.value for n in found}
        if len(gates) != 1:
            raise self.shape_error(
                "the norms gated by one name", ", ".join(sorted(gates))
            )
        return found

    def gate(self, tree, norms: list[Norm], used, new: dict, before: dict) -> None:
        gate = norms[0].gate.value
        at, value = _assignments(tree).get(gate, (None, None))
        value = _suffixed(value, cst.Or, IS_CPU, True)
        if gate == NORM_GATE or (at is not None and value is None):
            return
        if gate == GATE and at is not None:  # in place, where only the norms use it
            if used[GATE] != 1 + len(norms):
                raise self.shape_error(
                    f"{GATE} gating only the norms", f"{used[GATE]} uses"
                )
            new[at] = _assigned(tree, at, value)
            self.record(f"`{GATE}` gains `or {IS_CPU}`: it gates only the norms")
            return
        first = min(n.at for n in norms)
        own = _statement(f"{NORM_GATE} = {gate} or {IS_CPU}")
        lines = tree.body[first].leading_lines  # the def keeps its own two
        before.setdefault(first, []).append(own.with_changes(leading_lines=lines))
        for n in norms:
            new[n.at] = tree.body[n.at].deep_replace(n.gate, cst.Name(NORM_GATE))
        self.record(f"the norms' gate is `{NORM_GATE} = {gate} or {IS_CPU}`")

    def finish(self, tree, norms: list[Norm], cpu, used, new, before) -> cst.Module:
        if cpu is None:
            at = min([*new, *before])
            before[at] = [_statement(IS_CPU_LINE), *before.get(at, ())]
            self.record(f"`{IS_CPU_LINE}` caches the CPU check")
        added = before.setdefault(min(n.check_at for n in norms), [])
        if not used[FUNCTION]:
            functions = rule.functions(self.read_tree_file(rule.CPU_PY))
            blank = cst.EmptyLine(indent=False)
            added += [
                _in_newlines(f, tree).with_changes(leading_lines=[blank, blank])
                for f in functions
            ]
        if all(source(s) != DTYPES_LINES[0] for s in tree.body):
            added += [_statement(line) for line in DTYPES_LINES]
            self.record(
                f"`{FUNCTION}()` is added and called once: `{DTYPES_LINES[0]}`"
            )
        return rule.with_imports(_rebuild(tree, new, before), True)


class DisableVllmCOnCpu(EnableVllmCOnCpu):
    DESCRIPTION = "Undo EnableVllmCOnCpu, and what it added that nothing else uses."
    ON = False

    def gate(self, tree, norms: list[Norm], used, new: dict, before: dict) -> None:
        at, old = _assignments(tree).get(norms[0].gate.value, (None, None))
        old = _suffixed(old, cst.Or, IS_CPU, False)
        if old is None:
            return
        if norms[0].gate.value == NORM_GATE:
            new[at] = None
            new.update(
                (n.at, tree.body[n.at].deep_replace(n.gate, old)) for n in norms
            )
        else:
            new[at] = _assigned(tree, at, old)
        self.record(f"the norms' gate is `{source(old)}` again")

    def finish(self, tree, norms: list[Norm], cpu, used, new, before) -> cst.Module:
        left = names(_rebuild(tree, new, {}))
        called = any(source(s) == DTYPES_LINES[0] for s in tree.body)
        if called and left[DTYPES] == 1:
            for i, s in enumerate(tree.body):
                mine = (
                    isinstance(s, cst.FunctionDef)
                    and s.name.value in rule.FUNCTIONS
                )
                if source(s) in DTYPES_LINES or (mine and left[s.name.value] == 2):
                    new[i] = None  # the call, its docstring, the defs it alone uses
        if cpu is not None and names(_rebuild(tree, new, {}))[IS_CPU] == 1:
            new[cpu] = None
        return rule.with_imports(_rebuild(tree, new, {}), False)
