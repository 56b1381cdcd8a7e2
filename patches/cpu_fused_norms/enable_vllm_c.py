"""Mark the "vllm_c" RMSNorm impls of ``vllm/kernels/vllm_c.py`` (vLLM 0.20 -
0.32) supported on CPU, where the CPU kernels match native.

``IS_CPU`` joins the module's platform facts; the norms' gate gains ``or
IS_CPU``: ``GPGPU_DEVICE`` (0.27 on: only the norms use it) in place, else a
new ``RMS_NORM_DEVICE`` (``CUDA_ALIKE`` keeps its meaning). Each norm's
``supports_args`` lambda gains the rule's per-call checks on CPU, with
``rule.py``'s ``cpu_fused_norm_dtypes()`` called once at import.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

import libcst as cst

from patcher.codemod import TreeCodemod, names, source
from patcher.ruff_format import format_statements
from patches.cpu_fused_norms.identity import OPS, UPSTREAM_PROVIDER
from patches.rms_norm_forward_cpu.rule import call_checks, dtypes_function

GATE = "GPGPU_DEVICE"
NORM_GATE = "RMS_NORM_DEVICE"
IS_CPU = "IS_CPU"
IS_CPU_LINE = f"{IS_CPU} = current_platform.is_cpu()"
FUNCTION = "cpu_fused_norm_dtypes"
DTYPES = {"rms_norm": "CPU_DTYPES", "fused_add_rms_norm": "CPU_ADD_DTYPES"}
DTYPES_LINES = (
    f"{', '.join(DTYPES.values())} = {FUNCTION}()",
    '"""The dtypes in which the CPU kernels match native here, once per process."""',
)
CPU_PY = "vllm/platforms/cpu.py"
# How many leading parameters of each norm's supports_args are its input tensors.
TENSORS = {"rms_norm": 1, "fused_add_rms_norm": 2}
GONE = None  # a statement removed, in the ``new`` map _rebuild takes


@dataclass(frozen=True)
class Norm:
    """One norm's "vllm_c" impl: ``@ir.ops.<op>.register_impl("vllm_c",
    supports_args=<check>, supported=<gate>)`` with ``<check> = lambda ...``."""

    op: str
    at: int  # the decorated function's index among the module's statements
    gate: cst.Name
    check_at: int  # the ``<check> = lambda ...`` statement's
    check: cst.Lambda

    def gated(self, tree: cst.Module, gate: cst.BaseExpression):
        """The decorated function with ``supported=gate``."""
        return tree.body[self.at].deep_replace(self.gate, gate)

    @property
    def guard(self) -> str:
        """``(not IS_CPU or (<the rule's per-call checks>))`` on the lambda's
        parameters: the input tensors first, then the weight."""
        p = [x.name.value for x in self.check.params.params]
        x, residual = p[0], p[1] if TENSORS[self.op] > 1 else None
        weight = p[TENSORS[self.op]]
        checks = call_checks(x, weight, DTYPES[self.op], residual, True)
        return f"(not {IS_CPU} or ({checks}))"


def norm_impls(tree: cst.Module) -> dict[str, tuple[int, cst.Call]]:
    """op -> (its statement's index, its ``register_impl("vllm_c", ...)`` call)."""
    found = {}
    for i, stmt in enumerate(tree.body):
        for decorator in getattr(stmt, "decorators", ()):
            call = decorator.decorator
            func = source(call.func) if isinstance(call, cst.Call) else ""
            op = re.fullmatch(r"ir\.ops\.(\w+)\.register_impl", func)
            first = call.args[0].value if op and call.args else None
            if (
                op
                and op[1] in OPS
                and isinstance(first, cst.SimpleString)
                and first.evaluated_value == UPSTREAM_PROVIDER
            ):
                found[op[1]] = (i, call)
    return found


def _assignment(tree: cst.Module, name: str) -> int | None:
    """The index of the module-level ``name = ...`` statement."""
    for i, stmt in enumerate(tree.body):
        small = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) else None
        if isinstance(small, cst.Assign) and len(small.targets) == 1:
            target = small.targets[0].target
            if isinstance(target, cst.Name) and target.value == name:
                return i
    return None


def _value(tree: cst.Module, at: int) -> cst.BaseExpression:
    return tree.body[at].body[0].value


def _assigned(tree: cst.Module, at: int, value: cst.BaseExpression):
    """Statement ``at`` (``NAME = ...``) assigning ``value`` instead."""
    return tree.body[at].deep_replace(_value(tree, at), value)


def _ends_with(expr: cst.BaseExpression, operator: type, code: str) -> bool:
    """Whether ``expr`` is ``... <operator> code``, however laid out."""
    meaning = lambda c: ast.dump(ast.parse(c.strip(), mode="eval"))  # noqa: E731
    return (
        isinstance(expr, cst.BooleanOperation)
        and isinstance(expr.operator, operator)
        and meaning(source(expr.right)) == meaning(code)
    )


def _at(tree: cst.Module, code: str) -> int | None:
    """The index of the module-level statement whose code is ``code``."""
    return next((i for i, s in enumerate(tree.body) if source(s) == code), None)


def _docstring(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and isinstance(
        getattr(stmt.body[0], "value", None), cst.SimpleString
    )


def _statement(code: str, tree: cst.Module) -> cst.BaseStatement:
    return cst.parse_statement(code + tree.default_newline, tree.config_for_parsing)


def _rebuild(tree: cst.Module, new: dict, before: dict, layout=True) -> cst.Module:
    """``tree`` with statement ``i`` replaced by ``new[i]`` (``GONE``: removed)
    and ``before[i]`` inserted before it; what is new laid out by ruff."""
    body, formatted = [], set()
    for i, stmt in enumerate(tree.body):
        for added in before.get(i, ()):
            formatted.add(len(body))
            body.append(added)
        if new.get(i, stmt) is not GONE:
            formatted |= {len(body)} if i in new else set()
            body.append(new.get(i, stmt))
    tree = tree.with_changes(body=body)
    return format_statements(tree, formatted) if layout else tree


class _NormCodemod(TreeCodemod):
    def norms(self, tree: cst.Module) -> list[Norm]:
        found = []
        for op, (at, call) in norm_impls(tree).items():
            kw = {a.keyword.value: a.value for a in call.args if a.keyword}
            for key in ("supported", "supports_args"):
                if not isinstance(kw.get(key), cst.Name):
                    shown = source(kw[key]) if key in kw else "none"
                    raise self.shape_error(
                        f'{key}=NAME in the "vllm_c" {op} impl', shown
                    )
            check_at = _assignment(tree, kw["supports_args"].value)
            check = None if check_at is None else _value(tree, check_at)
            if not isinstance(check, cst.Lambda):
                raise self.shape_error(
                    f"{op}'s supports_args a module-level lambda",
                    source(kw["supports_args"]),
                )
            norm = Norm(op, at, kw["supported"], check_at, check)
            if len(check.params.params) < TENSORS[op] + 1:
                raise self.shape_error(
                    f"{op}'s supports_args taking its input tensors, then the weight",
                    source(check.params),
                )
            found.append(norm)
        if not found:
            raise self.shape_error(
                '@ir.ops.rms_norm.register_impl("vllm_c", ...)', "no such impl"
            )
        if len({n.gate.value for n in found}) != 1:
            gates = ", ".join(sorted({n.gate.value for n in found}))
            raise self.shape_error("the norms gated by one name", gates)
        return found


class EnableVllmCOnCpu(_NormCodemod):
    DESCRIPTION = (
        'Mark the "vllm_c" RMSNorm kernels supported on CPU (the norms\' gate gains '
        "`or IS_CPU`), where they match native: the eligibility rule's "
        f"{FUNCTION}() once at import, its per-call checks in supports_args."
    )

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        used = names(tree)
        for name in ("current_platform", "torch"):
            if not used[name]:
                raise self.shape_error(f"{name} imported", "none")
        norms = self.norms(tree)
        cpu = _assignment(tree, IS_CPU)
        if cpu is not None and source(tree.body[cpu]) != IS_CPU_LINE:
            raise self.shape_error(
                f"{IS_CPU} unassigned, or `{IS_CPU_LINE}`", source(tree.body[cpu])
            )
        new, before = {}, {}
        for n in norms:
            if not _ends_with(n.check.body, cst.And, n.guard):
                body = _and(n.check.body, cst.parse_expression(n.guard))
                new[n.check_at] = _assigned(
                    tree, n.check_at, n.check.with_changes(body=body)
                )
                self.record(f"the {n.op} impl's `supports_args` gains `and {n.guard}`")
        self._gate(tree, norms, new, before, used[GATE])
        if not new and not before:
            return tree
        if cpu is None:
            self._is_cpu(tree, before)
        first = min(n.check_at for n in norms)
        there = before.setdefault(first, [])
        added = []
        if not used[FUNCTION]:
            code = dtypes_function(self.read_tree_file(CPU_PY))
            added.append(cst.parse_statement(code, tree.config_for_parsing))
        if _at(tree, DTYPES_LINES[0]) is None:
            added += [_statement(line, tree) for line in DTYPES_LINES]
            self.record(f"`{FUNCTION}()` is added and called once: `{DTYPES_LINES[0]}`")
        at = int(bool(there) and source(there[0]) == IS_CPU_LINE)  # after IS_CPU
        there[at:at] = added
        return _rebuild(tree, new, before)

    def _is_cpu(self, tree: cst.Module, before: dict) -> None:
        """``IS_CPU`` after the last platform fact (and its docstring)."""
        facts = [
            i
            for i, s in enumerate(tree.body)
            if isinstance(s, cst.SimpleStatementLine)
            and isinstance(s.body[0], cst.Assign)
            and re.fullmatch(r"current_platform\.is_\w+\(\)", source(s.body[0].value))
        ]
        if not facts:
            raise self.shape_error(
                "constants such as CUDA_ALIKE = current_platform.is_cuda_alike()",
                "none",
            )
        at = facts[-1] + 1
        if at < len(tree.body) and _docstring(tree.body[at]):
            at += 1
        before[at] = [_statement(IS_CPU_LINE, tree), *before.get(at, ())]
        self.record(f"`{IS_CPU_LINE}` caches the CPU check")

    def _gate(self, tree, norms: list[Norm], new, before, uses: int) -> None:
        gate = norms[0].gate.value
        at = _assignment(tree, gate)
        if gate == NORM_GATE or (
            at is not None and _ends_with(_value(tree, at), cst.Or, IS_CPU)
        ):
            return
        if gate == GATE and at is not None:
            if uses != 1 + len(norms):
                raise self.shape_error(f"{GATE} gating only the norms", f"{uses} uses")
            value = cst.parse_expression(f"{source(_value(tree, at))} or {IS_CPU}")
            new[at] = _assigned(tree, at, value)
            self.record(f"`{GATE}` gains `or {IS_CPU}`: it gates only the norms")
            return
        first = min(n.at for n in norms)
        own = _statement(f"{NORM_GATE} = {gate} or {IS_CPU}", tree)
        lines = tree.body[first].leading_lines  # its blank lines, then ruff's two
        before.setdefault(first, []).append(own.with_changes(leading_lines=lines))
        for n in norms:
            new[n.at] = n.gated(tree, cst.Name(NORM_GATE))
        self.record(f"the norms' gate is `{NORM_GATE} = {gate} or {IS_CPU}`")


def _and(expr: cst.BaseExpression, operand: cst.BaseExpression):
    """``expr and operand``, in ``expr``'s outer parentheses: ``(a and b)``
    becomes ``(a and b and operand)``."""
    inner = expr.with_changes(lpar=[], rpar=[])
    if not (
        isinstance(inner, cst.BooleanOperation) and isinstance(inner.operator, cst.And)
    ):
        inner = inner.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return cst.BooleanOperation(inner, cst.And(), operand, expr.lpar, expr.rpar)


class DisableVllmCOnCpu(_NormCodemod):
    DESCRIPTION = (
        f"Undo EnableVllmCOnCpu: the norms' gate without `or {IS_CPU}`, their "
        f"supports_args without the CPU checks, and {FUNCTION}(), its call and "
        f"{IS_CPU} where nothing else uses them."
    )

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        norms = self.norms(tree)
        new = {}
        at = _assignment(tree, norms[0].gate.value)
        if at is not None and _ends_with(_value(tree, at), cst.Or, IS_CPU):
            old = _value(tree, at).left
            if norms[0].gate.value == NORM_GATE:
                new[at] = GONE
                new.update((n.at, n.gated(tree, old)) for n in norms)
            else:
                new[at] = _assigned(tree, at, old)
            self.record(f"the norms' gate is `{source(old)}` again")
        for n in norms:
            if _ends_with(n.check.body, cst.And, n.guard):
                body = n.check.body
                left = body.left.with_changes(lpar=body.lpar, rpar=body.rpar)
                new[n.check_at] = _assigned(
                    tree, n.check_at, n.check.with_changes(body=left)
                )
                self.record(f"the {n.op} impl's `supports_args` loses its CPU checks")
        if not new:
            return tree
        left = names(_rebuild(tree, new, {}, False))
        call = _at(tree, DTYPES_LINES[0])
        if call is not None and not any(left[n] > 1 for n in DTYPES.values()):
            new[call] = GONE
            if source(tree.body[call + 1]) == DTYPES_LINES[1]:
                new[call + 1] = GONE
            for i, s in enumerate(tree.body):
                function = isinstance(s, cst.FunctionDef) and s.name.value == FUNCTION
                if function and left[FUNCTION] == 2:  # its def and its call
                    new[i] = GONE
        cpu = _assignment(tree, IS_CPU)
        if cpu is not None and names(_rebuild(tree, new, {}, False))[IS_CPU] == 1:
            new[cpu] = GONE
        return _rebuild(tree, new, {})
