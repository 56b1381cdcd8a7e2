"""Mark the "vllm_c" RMSNorm implementations supported on CPU, for the inputs
the CPU kernels handle.

vLLM 0.20 - 0.32's ``vllm/kernels/vllm_c.py`` registers the norms' "vllm_c"
impls with ``supported=CUDA_ALIKE`` (0.20 - 0.26) or ``supported=GPGPU_DEVICE``
(0.27 on, a name only the norms use). The edit caches ``IS_CPU =
current_platform.is_cpu()`` after the module's platform facts; ``GPGPU_DEVICE``
gains ``or IS_CPU``, or the norms get ``RMS_NORM_DEVICE = CUDA_ALIKE or IS_CPU``
(``CUDA_ALIKE`` keeps its meaning); and each norm's ``supports_args`` lambda
gains ``and (not IS_CPU or <the kernel takes these inputs>)``. Every statement
it edits comes out as vLLM's ruff lays it out.
"""

from __future__ import annotations

import libcst as cst

from patcher.codemod import TreeCodemod, names, source
from patcher.ruff_format import format_statements
from patches.cpu_fused_norms.identity import OPS, UPSTREAM_PROVIDER

GATE = "GPGPU_DEVICE"
NORM_GATE = "RMS_NORM_DEVICE"
IS_CPU = "IS_CPU"
IS_CPU_LINES = (
    f"{IS_CPU} = current_platform.is_cpu()",
    '"""CPU kernels ignore strides: they only take contiguous inputs."""',
)
# How many leading parameters of each norm's supports_args are its input tensors.
TENSORS = {"rms_norm": 1, "fused_add_rms_norm": 2}


def _assigned(stmt: cst.CSTNode) -> tuple[str, cst.BaseExpression] | None:
    """(name, value) of a module-level ``NAME = value`` statement."""
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        small = stmt.body[0]
        if (
            isinstance(small, cst.Assign)
            and len(small.targets) == 1
            and isinstance(small.targets[0].target, cst.Name)
        ):
            return small.targets[0].target.value, small.value
    return None


def _platform_fact(stmt: cst.CSTNode) -> bool:
    """A constant caching a platform fact: ``IS_ROCM = current_platform.is_rocm()``."""
    found = _assigned(stmt)
    code = source(found[1]) if found else ""
    return code.startswith("current_platform.is_") and code.endswith("()")


def _docstring(stmt: cst.CSTNode) -> bool:
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and isinstance(stmt.body[0], cst.Expr)
        and isinstance(stmt.body[0].value, cst.SimpleString)
    )


def _norm_op(call: cst.CSTNode) -> str | None:
    """The op of ``ir.ops.<op>.register_impl("vllm_c", ...)``, if a norm."""
    if not (
        isinstance(call, cst.Call)
        and isinstance(call.func, cst.Attribute)
        and call.func.attr.value == "register_impl"
        and isinstance(call.func.value, cst.Attribute)
        and call.args
        and call.args[0].keyword is None
        and isinstance(call.args[0].value, cst.SimpleString)
        and call.args[0].value.evaluated_value == UPSTREAM_PROVIDER
    ):
        return None
    op = call.func.value.attr.value
    return op if op in OPS else None


def cpu_guard(tensors: list[str]) -> str:
    """``(not IS_CPU or x.is_contiguous())`` for the norm's input tensors."""
    contiguous = " and ".join(f"{t}.is_contiguous()" for t in tensors)
    return f"(not {IS_CPU} or {f'({contiguous})' if len(tensors) > 1 else contiguous})"


def norm_impls(tree: cst.Module) -> dict[str, tuple[int, int, cst.Call]]:
    """op -> (its statement's index, its decorator's, the ``register_impl("vllm_c",
    ...)`` call)."""
    found = {}
    for i, stmt in enumerate(tree.body):
        for j, decorator in enumerate(getattr(stmt, "decorators", ())):
            op = _norm_op(decorator.decorator)
            if op is not None:
                found[op] = (i, j, decorator.decorator)
    return found


def _keyword(call: cst.Call, name: str) -> cst.BaseExpression | None:
    return next(
        (a.value for a in call.args if a.keyword and a.keyword.value == name), None
    )


def _assignment(tree: cst.Module, name: str) -> int | None:
    """The index of the module-level ``name = ...`` statement."""
    return next(
        (i for i, s in enumerate(tree.body) if (_assigned(s) or ("",))[0] == name),
        None,
    )


def _value(tree: cst.Module, at: int) -> cst.BaseExpression:
    return tree.body[at].body[0].value


def _uses(tree: cst.Module, name: str) -> int:
    return names(tree)[name]


def _ends_with(expr: cst.BaseExpression, operator: type, code: str) -> bool:
    """Whether ``expr`` is ``... <operator> code``, however laid out."""
    return (
        isinstance(expr, cst.BooleanOperation)
        and isinstance(expr.operator, operator)
        and "".join(source(expr.right).split()) == "".join(code.split())
    )


def _and(expr: cst.BaseExpression, operand: cst.BaseExpression):
    """``expr and operand``, in ``expr``'s outer parentheses: ``(a and b)``
    becomes ``(a and b and operand)``."""
    inner = expr.with_changes(lpar=[], rpar=[])
    if not isinstance(inner, cst.BooleanOperation | cst.Comparison | cst.Name) or (
        isinstance(inner, cst.BooleanOperation) and isinstance(inner.operator, cst.Or)
    ):
        inner = inner.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return cst.BooleanOperation(
        inner, cst.And(), operand, lpar=expr.lpar, rpar=expr.rpar
    )


def _statement(code: str, tree: cst.Module) -> cst.BaseStatement:
    return cst.parse_statement(code + tree.default_newline, tree.config_for_parsing)


class _Edit:
    """The statements of one module being edited: replaced, inserted, removed
    by their index in the original, then laid out by ruff in one pass."""

    def __init__(self, tree: cst.Module) -> None:
        self.tree, self.body = tree, list(tree.body)
        self.inserted: dict[int, list[cst.BaseStatement]] = {}
        self.removed: set[int] = set()
        self.edited: set[int] = set()

    def assign(self, at: int, value: cst.BaseExpression) -> None:
        stmt = self.body[at]
        self.body[at] = stmt.with_changes(body=[stmt.body[0].with_changes(value=value)])
        self.edited.add(at)

    def keyword(self, at: int, j: int, name: str, value: cst.BaseExpression) -> None:
        """The ``name=`` argument of decorator ``j`` of statement ``at``."""
        decorators = list(self.body[at].decorators)
        call = decorators[j].decorator
        args = [
            a.with_changes(value=value) if a.keyword and a.keyword.value == name else a
            for a in call.args
        ]
        decorators[j] = decorators[j].with_changes(
            decorator=call.with_changes(args=args)
        )
        self.body[at] = self.body[at].with_changes(decorators=decorators)
        self.edited.add(at)

    def changed(self) -> bool:
        return bool(self.edited or self.inserted or self.removed)

    def result(self) -> cst.Module:
        body, formatted = [], set()
        for i, stmt in enumerate(self.body):
            for new in self.inserted.get(i, ()):
                formatted.add(len(body))
                body.append(new)
            if i in self.removed:
                continue
            if i in self.edited:
                formatted.add(len(body))
            body.append(stmt)
        return format_statements(self.tree.with_changes(body=body), formatted)


class _NormCodemod(TreeCodemod):
    def norms(self, tree: cst.Module) -> dict[str, tuple[int, int, cst.Call]]:
        norms = norm_impls(tree)
        if not norms:
            raise self.shape_error(
                '@ir.ops.rms_norm.register_impl("vllm_c", ...)', "no such impl"
            )
        for op, (_, _, call) in norms.items():
            for keyword in ("supported", "supports_args"):
                if _keyword(call, keyword) is None:
                    raise self.shape_error(
                        f'{keyword}= in the "vllm_c" {op} impl', "none"
                    )
        gates = {source(_keyword(c, "supported")) for _, _, c in norms.values()}
        if len(gates) != 1 or not gates.pop().isidentifier():
            raise self.shape_error("the norms gated by one name", ", ".join(gates))
        return norms

    @staticmethod
    def gate(norms) -> str:
        return _keyword(next(iter(norms.values()))[2], "supported").value

    def predicate(self, tree, op: str, call: cst.Call):
        """The norm's ``supports_args`` lambda, and its input tensors' names."""
        value = _keyword(call, "supports_args")
        if isinstance(value, cst.Name):
            at = _assignment(tree, value.value)
            value = value if at is None else _value(tree, at)
        if not isinstance(value, cst.Lambda):
            raise self.shape_error(
                f"a lambda as the {op} impl's supports_args", source(value)
            )
        params = [
            p.name.value for p in (*value.params.posonly_params, *value.params.params)
        ]
        if len(params) < TENSORS[op]:
            raise self.shape_error(
                f"{op}'s supports_args taking its input tensors first",
                f"parameters {params}",
            )
        return value, params[: TENSORS[op]]

    def set_predicate(self, tree, edit: _Edit, norm, new: cst.Lambda) -> None:
        at, j, call = norm
        named = _keyword(call, "supports_args")
        if isinstance(named, cst.Name):
            edit.assign(_assignment(tree, named.value), new)
        else:
            edit.keyword(at, j, "supports_args", new)


class EnableVllmCOnCpu(_NormCodemod):
    DESCRIPTION = (
        'Mark the "vllm_c" RMSNorm kernels supported on CPU (`IS_CPU` beside the '
        f"module's platform facts; {GATE} gains `or IS_CPU`, else the norms get "
        f"{NORM_GATE}), for the inputs the CPU kernels take."
    )

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        if not _uses(tree, "current_platform"):
            raise self.shape_error(
                "current_platform imported from vllm.platforms", "none"
            )
        norms = self.norms(tree)
        edit = _Edit(tree)
        self._gate(tree, norms, edit)
        for op, norm in norms.items():
            check, tensors = self.predicate(tree, op, norm[2])
            guard = cpu_guard(tensors)
            if not _ends_with(check.body, cst.And, guard):
                body = _and(check.body, cst.parse_expression(guard))
                self.set_predicate(tree, edit, norm, check.with_changes(body=body))
                self.record(
                    f"the {op} impl's `supports_args` refuses on CPU what the "
                    f"kernel does not take: `and {guard}`"
                )
        cpu = _assignment(tree, IS_CPU)
        if cpu is not None and source(_value(tree, cpu)) != "current_platform.is_cpu()":
            raise self.shape_error(
                f"{IS_CPU} unassigned, or `{IS_CPU_LINES[0]}`",
                source(tree.body[cpu]),
            )
        if edit.changed() and cpu is None:
            self._cpu_constant(tree, edit)
        return edit.result() if edit.changed() else tree

    def _cpu_constant(self, tree, edit: _Edit) -> None:
        """``IS_CPU`` and its docstring after the last platform fact (and its
        docstring)."""
        facts = [i for i, s in enumerate(tree.body) if _platform_fact(s)]
        if not facts:
            raise self.shape_error(
                "constants such as CUDA_ALIKE = current_platform.is_cuda_alike()",
                "none",
            )
        at = facts[-1] + 1
        at += at < len(tree.body) and _docstring(tree.body[at])
        lines = [_statement(line, tree) for line in IS_CPU_LINES]
        edit.inserted[at] = [*lines, *edit.inserted.get(at, ())]
        self.record(f"`{IS_CPU_LINES[0]}` caches the CPU check")

    def _gate(self, tree, norms, edit: _Edit) -> None:
        gate, at = self.gate(norms), _assignment(tree, self.gate(norms))
        if gate == NORM_GATE or (
            at is not None and _ends_with(_value(tree, at), cst.Or, IS_CPU)
        ):
            return
        if gate == GATE and at is not None:
            if _uses(tree, GATE) != 1 + len(norms):
                raise self.shape_error(
                    f"{GATE} gating only the norms", f"{_uses(tree, GATE)} uses"
                )
            value = cst.parse_expression(f"{source(_value(tree, at))} or {IS_CPU}")
            edit.assign(at, value)
            self.record(f"`{GATE}` gains `or {IS_CPU}`: it gates only the norms")
            return
        first = min(i for i, _, _ in norms.values())
        own = _statement(f"{NORM_GATE} = {gate} or {IS_CPU}", tree)
        lines = tree.body[first].leading_lines  # its blank lines, then ruff's two
        edit.inserted.setdefault(first, []).append(
            own.with_changes(leading_lines=lines)
        )
        for i, j, _ in norms.values():
            edit.keyword(i, j, "supported", cst.Name(NORM_GATE))
        self.record(
            f"the norms' `supported={gate}` becomes `{NORM_GATE}`, a new name for "
            f"`{gate} or {IS_CPU}` (`{gate}` keeps its meaning)"
        )


class DisableVllmCOnCpu(_NormCodemod):
    DESCRIPTION = (
        f"Undo EnableVllmCOnCpu: the norms' gate without `or {IS_CPU}`, their "
        f"supports_args without the CPU guard, and {IS_CPU} where nothing else uses it."
    )

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        norms = self.norms(tree)
        edit = _Edit(tree)
        gate, at = self.gate(norms), _assignment(tree, self.gate(norms))
        if at is not None and _ends_with(_value(tree, at), cst.Or, IS_CPU):
            old = _value(tree, at).left
            if gate == NORM_GATE:
                edit.removed.add(at)
                for i, j, _ in norms.values():
                    edit.keyword(i, j, "supported", old)
            else:
                edit.assign(at, old)
            self.record(f"the norms' gate is `{source(old)}` again")
        for op, norm in norms.items():
            check, tensors = self.predicate(tree, op, norm[2])
            if _ends_with(check.body, cst.And, cpu_guard(tensors)):
                body = check.body
                left = body.left.with_changes(lpar=body.lpar, rpar=body.rpar)
                self.set_predicate(tree, edit, norm, check.with_changes(body=left))
                self.record(f"the {op} impl's `supports_args` loses its CPU guard")
        if not edit.changed():
            return tree
        cpu = _assignment(tree, IS_CPU)
        left = cst.Module([s for i, s in enumerate(edit.body) if i not in edit.removed])
        if cpu is not None and _uses(left, IS_CPU) == 1:
            edit.removed.add(cpu)
            if source(tree.body[cpu + 1]) == IS_CPU_LINES[1]:
                edit.removed.add(cpu + 1)
        return edit.result()
