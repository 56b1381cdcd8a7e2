"""Mark the "vllm_c" RMSNorm implementations supported on CPU.

vLLM's CPU build ships ``torch.ops._C.rms_norm`` and ``fused_add_rms_norm``,
but ``vllm/kernels/vllm_c.py`` gates their IR implementations on GPU-like
platforms. Two source shapes exist:

* 0.27 and later: ``GPGPU_DEVICE = CUDA_ALIKE or current_platform.is_xpu()``
  gates the norms. It gains ``or current_platform.is_cpu()``, as upstream does.
* 0.20 to 0.26: each norm says ``supported=CUDA_ALIKE``; only those arguments
  gain ``or current_platform.is_cpu()``, because ``CUDA_ALIKE`` also gates
  kernels the CPU build does not have.

The CPU kernels ignore strides: on a non-contiguous input (a q/k slice of a
fused qkv projection, a transposed view) they return wrong numbers without an
error. So each norm's ``supports_args`` lambda also gains
``and (not current_platform.is_cpu() or x.is_contiguous())`` (with the residual
for the fused add), which sends such calls to the native implementation on CPU
and changes nothing elsewhere.

Every other "vllm_c" implementation is left exactly as it is.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from patcher.codemod import TreeCodemod
from patches.cpu_fused_norms.bool_operand import (
    append_operand,
    can_append,
    strip_operand,
)

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
ENDS_WITH_IS_CPU_OR = m.BooleanOperation(operator=m.Or(), right=IS_CPU)
ENDS_WITH_CPU_GUARD = m.BooleanOperation(
    operator=m.And(),
    right=m.BooleanOperation(operator=m.Or(), left=m.UnaryOperation(expression=IS_CPU)),
)


@dataclass(frozen=True)
class VllmCImpl:
    op: str
    supported: cst.BaseExpression | None
    """The ``supported=`` argument, or None when the call has none."""
    supports_args: cst.BaseExpression | None


def _keyword(call: cst.Call, name: str) -> cst.BaseExpression | None:
    return next(
        (a.value for a in call.args if m.matches(a.keyword, m.Name(name))), None
    )


def vllm_c_impls(module: cst.Module) -> list[VllmCImpl]:
    impls = []
    for call in m.findall(module, REGISTER_IMPL):
        op_attr = call.func.value
        impls.append(
            VllmCImpl(
                op_attr.attr.value,
                _keyword(call, "supported"),
                _keyword(call, "supports_args"),
            )
        )
    return impls


def module_assignments(module: cst.Module) -> dict[str, cst.BaseExpression]:
    """``NAME = value`` statements at module level."""
    found = {}
    for stmt in module.body:
        if m.matches(
            stmt, m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name())])])
        ):
            assign = stmt.body[0]
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


def cpu_guard(tensors: list[str]) -> cst.BaseExpression:
    """``(not current_platform.is_cpu() or x.is_contiguous())``."""
    contiguous = " and ".join(f"{t}.is_contiguous()" for t in tensors)
    if len(tensors) > 1:
        contiguous = f"({contiguous})"
    return cst.parse_expression(f"(not {IS_CPU_SOURCE} or {contiguous})")


def _describe(impls: list[VllmCImpl]) -> str:
    if not impls:
        return 'no @ir.ops.<op>.register_impl("vllm_c", ...) at all'
    return "vllm_c impls for " + ", ".join(i.op for i in impls)


class _NormCodemod(TreeCodemod):
    """Finds the norm impls' gate and argument check; subclasses edit them."""

    TARGET = "vllm/kernels/vllm_c.py"
    edits: dict[cst.CSTNode, Callable[[cst.CSTNode], cst.CSTNode]]

    def norms(self, tree: cst.Module) -> list[VllmCImpl]:
        impls = vllm_c_impls(tree)
        norms = [i for i in impls if i.op in NORM_OPS]
        if not norms:
            raise self.shape_error(
                looked_for='@ir.ops.rms_norm.register_impl("vllm_c", ...) '
                "(or fused_add_rms_norm)",
                found=_describe(impls),
            )
        for impl in norms:
            for keyword in ("supported", "supports_args"):
                if getattr(impl, keyword) is None:
                    raise self.shape_error(
                        looked_for=f'{keyword}= in the "vllm_c" {impl.op} impl',
                        found=f"register_impl without {keyword}=",
                    )
        return norms

    def supports_args_lambda(self, impl: VllmCImpl, assignments: dict) -> cst.Lambda:
        """The lambda behind ``supports_args=`` (inline or a module-level name)."""
        value = impl.supports_args
        if isinstance(value, cst.Name):
            value = assignments.get(value.value, value)
        if not isinstance(value, cst.Lambda):
            raise self.shape_error(
                looked_for=f"a lambda as the {impl.op} impl's supports_args",
                found=cst.Module([]).code_for_node(value),
            )
        return value

    def on_leave(self, original_node, updated_node):
        updated_node = super().on_leave(original_node, updated_node)
        edit = self.edits.get(original_node)
        return edit(updated_node) if edit else updated_node


class EnableVllmCOnCpu(_NormCodemod):
    DESCRIPTION = (
        'Mark the "vllm_c" RMSNorm kernels supported on CPU '
        f"({GATE} or the norms' supported= gain {IS_CPU_SOURCE}), "
        "for contiguous inputs (the CPU kernels ignore strides)."
    )

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        if not m.findall(tree, m.Name("current_platform")):
            raise self.shape_error(
                looked_for="current_platform imported from vllm.platforms",
                found="no current_platform in the module",
            )
        assignments = module_assignments(tree)
        self.edits = {}
        for impl in self.norms(tree):
            self._gate(impl, assignments)
            self._guard(impl, assignments)
        return tree.visit(self)

    def _gate(self, impl: VllmCImpl, assignments: dict) -> None:
        if enables_cpu(impl.supported, assignments):
            return
        gate = m.matches(impl.supported, m.Name(GATE)) and assignments.get(GATE)
        target = gate or impl.supported
        self._append(target, cst.Or, cst.parse_expression(IS_CPU_SOURCE))

    def _guard(self, impl: VllmCImpl, assignments: dict) -> None:
        check = self.supports_args_lambda(impl, assignments)
        if m.findall(check.body, IS_CPU):
            return
        params = [p.name.value for p in check.params.params]
        if "weight" not in params[1:]:
            raise self.shape_error(
                looked_for=f"{impl.op}'s supports_args lambda: tensors, then `weight`",
                found=f"parameters {params}",
            )
        self._append(check.body, cst.And, cpu_guard(params[: params.index("weight")]))

    def _append(self, target, operator: type[cst.BaseBooleanOp], operand) -> None:
        if not can_append(target, operator):
            raise self.shape_error(
                looked_for=f"an operand to extend: `... {operator.__name__.lower()} X`",
                found=cst.Module([]).code_for_node(target),
            )
        self.edits.setdefault(target, lambda n: append_operand(n, operator, operand))


class DisableVllmCOnCpu(_NormCodemod):
    DESCRIPTION = "Undo EnableVllmCOnCpu: drop the CPU gate and contiguity check."

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        assignments = module_assignments(tree)
        candidates = []
        for impl in self.norms(tree):
            candidates.append((impl.supported, ENDS_WITH_IS_CPU_OR))
            lambda_ = self.supports_args_lambda(impl, assignments)
            candidates.append((lambda_.body, ENDS_WITH_CPU_GUARD))
        if GATE in assignments:
            candidates.append((assignments[GATE], ENDS_WITH_IS_CPU_OR))
        self.edits = {}
        for expr, ours in candidates:
            if m.matches(expr, ours):
                self.edits[expr] = strip_operand
            elif m.findall(expr, IS_CPU):
                raise self.shape_error(
                    looked_for=f"{IS_CPU_SOURCE} only in the last operand",
                    found=cst.Module([]).code_for_node(expr).strip(),
                )
        return tree.visit(self)
