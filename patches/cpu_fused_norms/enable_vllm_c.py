"""Mark the "vllm_c" RMSNorm implementations supported on CPU.

vLLM's CPU build ships ``torch.ops._C.rms_norm`` and ``fused_add_rms_norm``,
but ``vllm/kernels/vllm_c.py`` gates their IR implementations on GPU-like
platforms. Two source shapes exist:

* 0.27 and later: ``GPGPU_DEVICE = CUDA_ALIKE or current_platform.is_xpu()``
  gates the norms. It gains ``or current_platform.is_cpu()``, as upstream does.
* 0.20 to 0.26: each norm says ``supported=CUDA_ALIKE``; only those arguments
  gain ``or current_platform.is_cpu()``, because ``CUDA_ALIKE`` also gates
  kernels the CPU build does not have.

Every other "vllm_c" implementation is left exactly as it is.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from patcher.codemod import TreeCodemod
from patches.cpu_fused_norms.or_operand import append_or, strip_or

NORM_OPS = ("rms_norm", "fused_add_rms_norm")
GATE = "GPGPU_DEVICE"
PROVIDER = "vllm_c"
IS_CPU_SOURCE = "current_platform.is_cpu()"
IS_CPU = m.Call(
    func=m.Attribute(value=m.Name("current_platform"), attr=m.Name("is_cpu")), args=()
)
# @ir.ops.<op>.register_impl("vllm_c", ...)
REGISTER_IMPL = m.Call(
    func=m.Attribute(
        value=m.Attribute(value=m.Attribute(value=m.Name("ir"), attr=m.Name("ops"))),
        attr=m.Name("register_impl"),
    ),
    args=[
        m.Arg(
            value=m.SimpleString(
                m.MatchIfTrue(lambda s: ast.literal_eval(s) == PROVIDER)
            ),
            keyword=None,
        ),
        m.ZeroOrMore(),
    ],
)
UNSAFE_LEFT_OF_OR = (cst.IfExp, cst.Lambda, cst.NamedExpr)


@dataclass(frozen=True)
class VllmCImpl:
    op: str
    supported: cst.BaseExpression | None
    """The ``supported=`` argument, or None when the call has none."""


def vllm_c_impls(module: cst.Module) -> list[VllmCImpl]:
    impls = []
    for call in m.findall(module, REGISTER_IMPL):
        assert isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute)
        op_attr = call.func.value
        assert isinstance(op_attr, cst.Attribute)
        supported = next(
            (a.value for a in call.args if m.matches(a.keyword, m.Name("supported"))),
            None,
        )
        impls.append(VllmCImpl(op_attr.attr.value, supported))
    return impls


def module_assignments(module: cst.Module) -> dict[str, cst.BaseExpression]:
    """``NAME = value`` statements at module level."""
    found = {}
    for stmt in module.body:
        for assign in m.findall(stmt, m.Assign(targets=[m.AssignTarget(m.Name())])):
            if isinstance(stmt, cst.SimpleStatementLine) and assign in stmt.body:
                found[assign.targets[0].target.value] = assign.value
    return found


def enables_cpu(expr: cst.BaseExpression, assignments: dict) -> bool:
    """Does ``expr`` call ``current_platform.is_cpu()``, directly or through a
    module-level name?"""
    seen: set[str] = set()
    todo = [expr]
    while todo:
        node = todo.pop()
        if m.findall(node, IS_CPU):
            return True
        for name in m.findall(node, m.Name()):
            value = assignments.get(name.value)
            if value is not None and name.value not in seen:
                seen.add(name.value)
                todo.append(value)
    return False


def cpu_enabled_ops(module: cst.Module) -> list[str]:
    """Ops whose "vllm_c" implementation is supported on CPU in ``module``."""
    assignments = module_assignments(module)
    return [
        i.op
        for i in vllm_c_impls(module)
        if i.supported is not None and enables_cpu(i.supported, assignments)
    ]


def _describe(impls: list[VllmCImpl]) -> str:
    if not impls:
        return 'no @ir.ops.<op>.register_impl("vllm_c", ...) at all'
    return "vllm_c impls for " + ", ".join(i.op for i in impls)


class _NormGateCodemod(TreeCodemod):
    TARGET = "vllm/kernels/vllm_c.py"

    def gated_norms(self, tree: cst.Module) -> list[VllmCImpl]:
        impls = vllm_c_impls(tree)
        norms = [i for i in impls if i.op in NORM_OPS]
        if not norms:
            raise self.shape_error(
                looked_for='@ir.ops.rms_norm.register_impl("vllm_c", ...) '
                "(or fused_add_rms_norm)",
                found=_describe(impls),
            )
        for impl in norms:
            if impl.supported is None:
                raise self.shape_error(
                    looked_for=f'a supported= argument in the "vllm_c" {impl.op} impl',
                    found="register_impl without supported=",
                )
        return norms

    def on_leave(self, original_node, updated_node):
        updated_node = super().on_leave(original_node, updated_node)
        edit = self.edits.get(original_node)
        return edit(updated_node) if edit else updated_node


class EnableVllmCOnCpu(_NormGateCodemod):
    DESCRIPTION = (
        'Mark the "vllm_c" RMSNorm kernels supported on CPU '
        f"({GATE} or the norms' supported= gain {IS_CPU_SOURCE})."
    )

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        assignments = module_assignments(tree)
        if not m.findall(tree, m.Name("current_platform")):
            raise self.shape_error(
                looked_for="current_platform imported from vllm.platforms",
                found="no current_platform in the module",
            )
        extend: list[cst.BaseExpression] = []
        for impl in self.gated_norms(tree):
            if enables_cpu(impl.supported, assignments):
                continue
            gate = m.matches(impl.supported, m.Name(GATE)) and assignments.get(GATE)
            target = gate or impl.supported
            if isinstance(target, UNSAFE_LEFT_OF_OR) and not target.lpar:
                raise self.shape_error(
                    looked_for="a boolean expression to extend with `or`",
                    found=type(target).__name__,
                )
            if target not in extend:
                extend.append(target)
        operand = cst.parse_expression(IS_CPU_SOURCE)
        self.edits = {node: (lambda n: append_or(n, operand)) for node in extend}
        return tree.visit(self)


class DisableVllmCOnCpu(_NormGateCodemod):
    DESCRIPTION = f"Undo EnableVllmCOnCpu: drop the trailing `or {IS_CPU_SOURCE}`."

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        candidates = [i.supported for i in self.gated_norms(tree)]
        gate = module_assignments(tree).get(GATE)
        if gate is not None:
            candidates.append(gate)
        strip = []
        for expr in candidates:
            if m.matches(expr, m.BooleanOperation(operator=m.Or(), right=IS_CPU)):
                strip.append(expr)
            elif m.findall(expr, IS_CPU):
                raise self.shape_error(
                    looked_for=f"`... or {IS_CPU_SOURCE}` as the last operand",
                    found=cst.Module([]).code_for_node(expr).strip(),
                )
        self.edits = {node: strip_or for node in strip}
        return tree.visit(self)
