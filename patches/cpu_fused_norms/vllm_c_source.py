"""What ``vllm/kernels/vllm_c.py`` says: its "vllm_c" impls, their gates, and
on which platforms a gate is true (evaluated, not searched for: ``or not
current_platform.is_cpu()`` mentions CPU but excludes it)."""

from __future__ import annotations

import ast
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

import libcst as cst
import libcst.matchers as m

from patches.cpu_fused_norms.identity import OPS as NORM_OPS
from patches.cpu_fused_norms.identity import UPSTREAM_PROVIDER

# How many leading parameters of each norm's supports_args are the input
# tensors the CPU kernel reads ignoring their strides.
NORM_TENSORS = {"rms_norm": 1, "fused_add_rms_norm": 2}
IS_CPU_SOURCE = "current_platform.is_cpu()"
IS_CPU = m.Call(
    func=m.Attribute(value=m.Name("current_platform"), attr=m.Name("is_cpu")), args=()
)
PLATFORM_CALL = m.Call(
    func=m.Attribute(value=m.Name("current_platform"), attr=m.Name()), args=()
)
# What current_platform.is_*() says on CPU, CUDA, ROCm and XPU (every other
# is_*() says no on all four).
PLATFORM_CHECKS = {
    "is_cpu": {"cpu"},
    "is_cuda": {"cuda"},
    "is_rocm": {"rocm"},
    "is_cuda_alike": {"cuda", "rocm"},
    "is_xpu": {"xpu"},
}
# @ir.ops.<op>.register_impl("vllm_c", ...)
REGISTER_IMPL = m.Call(
    func=m.Attribute(
        value=m.Attribute(value=m.Attribute(value=m.Name("ir"), attr=m.Name("ops"))),
        attr=m.Name("register_impl"),
    ),
    args=[
        m.Arg(
            value=m.SimpleString(
                m.MatchIfTrue(lambda s: ast.literal_eval(s) == UPSTREAM_PROVIDER)
            ),
            keyword=None,
        ),
        m.ZeroOrMore(),
    ],
)
# The module constant the edit caches the CPU check in, as vllm_c.py caches
# its other platform facts (CUDA_ALIKE, IS_ROCM), with its docstring.
CPU_CONSTANT = "IS_CPU"
CPU_CONSTANT_SOURCE = f"{CPU_CONSTANT} = {IS_CPU_SOURCE}"
CPU_CONSTANT_DOC = '"""CPU kernels ignore strides: they only take contiguous inputs."""'
CPU_CHECK = IS_CPU | m.Name(CPU_CONSTANT)
ENDS_WITH_IS_CPU_OR = m.BooleanOperation(operator=m.Or(), right=CPU_CHECK)


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


@lru_cache(maxsize=16)  # modules hash by identity; each is read many times
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


class _NameCounter(cst.CSTVisitor):
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def visit_Name(self, node: cst.Name) -> None:
        self.counts[node.value] += 1


@lru_cache(maxsize=16)
def name_counts(module: cst.Module) -> Counter[str]:
    """How often each name occurs in ``module``."""
    counter = _NameCounter()
    module.visit(counter)
    return counter.counts


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


def admits(
    expr: cst.BaseExpression, platform: str, assignments: dict, seen: tuple = ()
) -> bool | None:
    """Whether the gate ``expr`` is true on ``platform``; None when it depends on
    something other than ``current_platform.is_*()``, constants, module-level
    names built from them, ``not``, ``and`` and ``or``."""
    if isinstance(expr, cst.Name):
        if expr.value in ("True", "False"):
            return expr.value == "True"
        value = assignments.get(expr.value)
        if value is None or expr.value in seen:
            return None
        return admits(value, platform, assignments, (*seen, expr.value))
    if m.matches(expr, PLATFORM_CALL):
        check = expr.func.attr.value
        if not check.startswith("is_"):
            return None
        return platform in PLATFORM_CHECKS.get(check, ())
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Not):
        value = admits(expr.expression, platform, assignments, seen)
        return None if value is None else not value
    if isinstance(expr, cst.BooleanOperation):
        left = admits(expr.left, platform, assignments, seen)
        right = admits(expr.right, platform, assignments, seen)
        decisive = isinstance(expr.operator, cst.Or)  # True decides `or`
        if decisive in (left, right):
            return decisive
        return None if None in (left, right) else not decisive
    return None


def cpu_enabled_ops(module: cst.Module) -> list[str]:
    """Ops whose "vllm_c" implementation is supported on CPU in ``module``."""
    assignments = module_assignments(module)
    return [
        i.op
        for i in vllm_c_impls(module)
        if i.supported is not None and admits(i.supported, "cpu", assignments)
    ]


def cpu_enabled_norms(module: cst.Module) -> list[str]:
    """The norms (of ``NORM_OPS``) whose "vllm_c" impl is supported on CPU."""
    enabled = cpu_enabled_ops(module)
    return [op for op in NORM_OPS if op in enabled]


def cpu_guard(
    tensors: list[str] | tuple[str, ...], check: str = CPU_CONSTANT
) -> cst.BaseExpression:
    """``(not IS_CPU or x.is_contiguous())``, or with another ``check``."""
    contiguous = " and ".join(f"{t}.is_contiguous()" for t in tensors)
    if len(tensors) > 1:
        contiguous = f"({contiguous})"
    return cst.parse_expression(f"(not {check} or {contiguous})")


def contiguity_sentence(tensors: list[str] | tuple[str, ...]) -> str:
    """What a norm's ``supports_args`` docstring gains: its CPU requirement."""
    names = " and ".join(tensors)
    return f"On CPU, {names} must also be contiguous."
