"""Let vLLM's IR norm tests run the "vllm_c" kernels on CPU, and pin the guard.

``tests/kernels/ir/test_layernorm.py`` skips its ``rms_norm`` registration test
and ``TestRMSNorm`` (and, where the file has them, the ``fused_add_rms_norm``
ones) unless the platform is CUDA-alike or XPU, and expects ``"vllm_c"``
supported only there. So once the kernels run on CPU, vLLM's own tests would
neither exercise them nor notice if the gate regressed. This edit, in a vLLM
checkout:

* adds ``and not current_platform.is_cpu()`` to the ``skipif`` of exactly those
  tests (their reason gains "CPU"), so they run on CPU;
* keeps skipped on CPU what did not run there before and is not about
  ``"vllm_c"``: in those test classes, a test without a ``provider`` parameter
  (the native semantics) gets ``skipif(current_platform.is_cpu())``, and a
  test whose providers can include ``"native"`` skips every provider but
  ``"vllm_c"`` on CPU as its first statement (after a docstring);
* adds ``or current_platform.is_cpu()`` to the ``"vllm_c"`` entry of their
  registration expectation;
* appends, per norm op in the file, a CPU-only test: a non-contiguous input (a
  q/k-style slice of a wider row) is refused by the ``"vllm_c"`` impl's
  ``supports_args``, and the dispatched call returns what native returns.

Every other test keeps its skip (ROCm-only tests, other ops such as
``rms_norm_gated``). Lines are written as ruff formats them (88 columns), so
the inverse edit gives the original bytes back.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from patcher.codemod import TreeCodemod
from patcher.ruff_format import LINE_LENGTH
from patches.cpu_fused_norms.bool_operand import append_operand, strip_operand
from patches.cpu_fused_norms.vllm_c_source import (
    ENDS_WITH_IS_CPU_OR,
    IS_CPU,
    IS_CPU_SOURCE,
    PROVIDER,
)

NOT_CPU = f"not {IS_CPU_SOURCE}"
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
    key=m.SimpleString(m.MatchIfTrue(lambda s: ast.literal_eval(s) == PROVIDER))
)
REASON = re.compile(r"(Currently only kernels on )(.+)")
CPU_SCOPE = f"On CPU, only the {PROVIDER} kernels are tested"
"""Why a test of the un-skipped classes still skips on CPU."""
# Laid out as ruff lays them out in a class (the decorator does not fit a line).
SKIP_TEST_ON_CPU = f"""\
@pytest.mark.skipif(
    {IS_CPU_SOURCE}, reason="{CPU_SCOPE}"
)"""
SKIP_PROVIDER_ON_CPU = f"""\
if {IS_CPU_SOURCE} and provider != "{PROVIDER}":
    pytest.skip("{CPU_SCOPE}")
"""
PROVIDER_PARAM = "provider"
NATIVE = "native"
SUPPORTED_PROVIDERS = "supported_providers"
PARAMETRIZE = m.Decorator(
    decorator=m.Call(
        func=m.Attribute(attr=m.Name("parametrize")),
        args=[m.Arg(m.SimpleString()), m.Arg(), m.ZeroOrMore()],
    )
)


@dataclass(frozen=True)
class NormTests:
    """The tests of one norm op that this edit touches, by their names upstream."""

    op: str
    registration: str
    suite: str
    added: str
    """The CPU contiguity test this edit appends (ruff-formatted source)."""

    @property
    def added_name(self) -> str:
        return self.added.split("def ", 1)[1].split("(", 1)[0]


RMS_NORM = NormTests(
    "rms_norm",
    "test_rms_norm_registration",
    "TestRMSNorm",
    """\
@pytest.mark.skipif(not current_platform.is_cpu(), reason="CPU kernels ignore strides")
def test_rms_norm_vllm_c_sends_non_contiguous_input_to_native_on_cpu():
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
def test_fused_add_rms_norm_vllm_c_sends_non_contiguous_input_to_native_on_cpu():
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


def render_skipif(operands: list[str], reason: str, magic_comma: bool) -> str:
    """``@pytest.mark.skipif(cond, reason=...)`` as ruff lays it out at module level."""
    cond = " and ".join(operands)
    flat = f"@pytest.mark.skipif({cond}, reason={reason})"
    if not magic_comma and len(flat) <= LINE_LENGTH:
        return flat
    if len(f"    {cond},") <= LINE_LENGTH:
        lines = [f"    {cond},"]
    else:
        lines = [f"    {operands[0]}", *(f"    and {o}" for o in operands[1:])]
        lines[-1] += ","
    return "\n".join(["@pytest.mark.skipif(", *lines, f"    reason={reason},", ")"])


def _parse_decorator(source: str) -> cst.Decorator:
    return cst.parse_statement(f"{source}\ndef f(): pass\n").decorators[0]


SKIP_TEST_DECORATOR = _parse_decorator(SKIP_TEST_ON_CPU)
SKIP_PROVIDER_STATEMENT = cst.parse_statement(SKIP_PROVIDER_ON_CPU)


def _test_methods(suite: cst.ClassDef) -> list[cst.FunctionDef]:
    return [
        s
        for s in suite.body.body
        if isinstance(s, cst.FunctionDef) and s.name.value.startswith("test")
    ]


def _providers(method: cst.FunctionDef) -> cst.BaseExpression | None:
    """What ``method`` is parametrised over as ``provider``, if it is."""
    for decorator in method.decorators:
        if m.matches(decorator, PARAMETRIZE):
            args = decorator.decorator.args
            if ast.literal_eval(args[0].value.value) == PROVIDER_PARAM:
                return args[1].value
    return None


def _may_run_native(providers: cst.BaseExpression | None) -> bool:
    """Whether a provider list can hold ``"native"``, the one provider besides
    ``PROVIDER`` that is supported on CPU. Other providers need no CPU skip:
    their tests already skip or leave out platforms without them (as on CUDA
    for ROCm's), which vLLM's ``supported_providers`` also does, for native too."""
    if providers is None:
        return True
    if m.matches(providers, m.Call(func=m.Name(SUPPORTED_PROVIDERS))):
        return False
    try:
        return NATIVE in ast.literal_eval(_code(providers))
    except (ValueError, TypeError, SyntaxError):
        return True


def _body_start(body: list[cst.BaseStatement]) -> int:
    """Where a method's first statement after its docstring is."""
    first = body[0] if body else None
    docstring = m.SimpleStatementLine(
        body=[m.Expr(m.SimpleString() | m.ConcatenatedString())]
    )
    return 1 if first is not None and m.matches(first, docstring) else 0


def _keeps_cpu_skip(method: cst.FunctionDef) -> str | None:
    """How ``method`` stays skipped on CPU where it is not about ``PROVIDER``:
    ``"test"`` (no provider parameter: skipped whole), ``"providers"`` (native
    skips), or None (nothing but ``PROVIDER`` runs on CPU)."""
    params = [p.name.value for p in method.params.params]
    if PROVIDER_PARAM not in params:
        return "test"
    return "providers" if _may_run_native(_providers(method)) else None


def _with_cpu_skip(method: cst.FunctionDef) -> cst.FunctionDef:
    """``method`` skipped on CPU as :func:`_keeps_cpu_skip` says (unchanged when
    it already is)."""
    kind = _keeps_cpu_skip(method)
    if kind == "test":
        if any(d.deep_equals(SKIP_TEST_DECORATOR) for d in method.decorators):
            return method
        return method.with_changes(decorators=[*method.decorators, SKIP_TEST_DECORATOR])
    body = list(method.body.body)
    at = _body_start(body)
    if kind is None or (
        at < len(body) and body[at].deep_equals(SKIP_PROVIDER_STATEMENT)
    ):
        return method
    body.insert(at, SKIP_PROVIDER_STATEMENT)
    return method.with_changes(body=method.body.with_changes(body=body))


def _without_cpu_skip(method: cst.FunctionDef) -> cst.FunctionDef:
    """The inverse of :func:`_with_cpu_skip`."""
    decorators = [
        d for d in method.decorators if not d.deep_equals(SKIP_TEST_DECORATOR)
    ]
    body = list(method.body.body)
    at = _body_start(body)
    if at < len(body) and body[at].deep_equals(SKIP_PROVIDER_STATEMENT):
        del body[at]
    return method.with_changes(
        decorators=decorators, body=method.body.with_changes(body=body)
    )


class _IrNormTestsCodemod(TreeCodemod):
    """Finds the norm tests' skips and registration expectations."""

    replace: dict[cst.CSTNode, cst.CSTNode]

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
                looked_for=f'one "{PROVIDER}": ... entry in {test.name.value}\'s '
                "expected providers",
                found=f"{len(entries)} such entries",
            )
        return entries[0]

    def with_skipif(
        self, decorator: cst.Decorator, operands: list[str], cpu: bool
    ) -> cst.Decorator:
        call = decorator.decorator
        reason = _reason(_code(call.args[1].value), cpu)
        magic = not isinstance(call.args[-1].comma, cst.MaybeSentinel)
        new = _parse_decorator(render_skipif(operands, reason, magic))
        return new.with_changes(leading_lines=decorator.leading_lines)

    def replaced(self, tree: cst.Module, replace: dict) -> cst.Module:
        """``tree`` with each key node (by identity) replaced by its value."""
        self.replace = replace
        return tree.visit(self)

    def on_leave(self, original_node, updated_node):
        updated_node = super().on_leave(original_node, updated_node)
        return self.replace.get(original_node, updated_node)


class RunIrNormTestsOnCpu(_IrNormTestsCodemod):
    DESCRIPTION = (
        "Run the rms_norm and fused_add_rms_norm IR tests on CPU, expect "
        f'"{PROVIDER}" supported there, and test that a non-contiguous input on '
        "CPU goes to native."
    )

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        replace: dict[cst.CSTNode, cst.CSTNode] = {}
        for _, tests in self.norms(tree):
            for test in tests:
                decorator = self.skipif(test)
                operands = [
                    _code(o) for o in _and_operands(decorator.decorator.args[0].value)
                ]
                if NOT_CPU not in operands:
                    replace[decorator] = self.with_skipif(
                        decorator, [*operands, NOT_CPU], cpu=True
                    )
                    self.record(f"`{test.name.value}` also runs on CPU.")
            suite = tests[-1]
            if isinstance(suite, cst.ClassDef):
                self.keep_other_tests_skipped(suite, replace)
            entry = self.vllm_c_entry(tests[0])
            if not m.findall(entry.value, IS_CPU):
                operand = cst.parse_expression(IS_CPU_SOURCE)
                replace[entry.value] = append_operand(entry.value, cst.Or, operand)
                self.record(
                    f"`{tests[0].name.value}` expects `{PROVIDER}` supported on CPU."
                )
        return self._append_tests(self.replaced(tree, replace))

    def keep_other_tests_skipped(
        self, suite: cst.ClassDef, replace: dict[cst.CSTNode, cst.CSTNode]
    ) -> None:
        """In a test class now running on CPU, what is not about ``PROVIDER``
        stays skipped there."""
        kept: dict[str, list[str]] = {"test": [], "providers": []}
        for method in _test_methods(suite):
            edited = _with_cpu_skip(method)
            if edited is not method:
                replace[method] = edited
                kept[_keeps_cpu_skip(method)].append(f"`{method.name.value}`")
        said = []
        if kept["test"]:
            verb = "stays" if len(kept["test"]) == 1 else "stay"
            said.append(f"{', '.join(kept['test'])} {verb} skipped")
        if kept["providers"]:
            verb = "skips" if len(kept["providers"]) == 1 else "skip"
            said.append(
                f"{', '.join(kept['providers'])} {verb} providers other than "
                f"`{PROVIDER}`"
            )
        if said:
            self.record(f"In `{suite.name.value}`, on CPU: {'; '.join(said)}.")

    def _append_tests(self, tree: cst.Module) -> cst.Module:
        found = self.found_tests(tree)
        body = list(tree.body)
        for norm, _ in self.norms(tree):
            if norm.added_name not in found:
                added = cst.parse_module(norm.added).body[0]
                body.append(added.with_changes(leading_lines=[cst.EmptyLine()] * 2))
                self.record(
                    f"New `{norm.added_name}`: on CPU a non-contiguous input is "
                    f"refused by `{PROVIDER}` and the dispatched call matches native."
                )
        return tree.with_changes(body=body)


class StopIrNormTestsOnCpu(_IrNormTestsCodemod):
    DESCRIPTION = "Undo RunIrNormTestsOnCpu: the CPU skips, expectation and test."

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        replace: dict[cst.CSTNode, cst.CSTNode] = {}
        norms = self.norms(tree)
        for _, tests in norms:
            for test in tests:
                decorator = self.skipif(test)
                operands = [
                    _code(o) for o in _and_operands(decorator.decorator.args[0].value)
                ]
                if operands[-1] == NOT_CPU and len(operands) > 1:
                    replace[decorator] = self.with_skipif(
                        decorator, operands[:-1], cpu=False
                    )
            if isinstance(tests[-1], cst.ClassDef):
                for method in _test_methods(tests[-1]):
                    edited = _without_cpu_skip(method)
                    if not edited.deep_equals(method):
                        replace[method] = edited
            value = self.vllm_c_entry(tests[0]).value
            if m.matches(value, ENDS_WITH_IS_CPU_OR):
                replace[value] = strip_operand(value)
        tree = self.replaced(tree, replace)
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
        return tree.with_changes(body=body)
