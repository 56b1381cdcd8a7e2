"""Mark the "vllm_c" RMSNorm implementations supported on CPU, where the CPU
kernels match the native norm.

vLLM 0.20 - 0.32's ``vllm/kernels/vllm_c.py`` registers the norms' "vllm_c"
impls with ``supported=CUDA_ALIKE`` (0.20 - 0.26) or ``supported=GPGPU_DEVICE``
(0.27 on, a name only the norms use). The edit caches ``IS_CPU =
current_platform.is_cpu()`` after the module's platform facts; ``GPGPU_DEVICE``
gains ``or IS_CPU``, or the norms get ``RMS_NORM_DEVICE = CUDA_ALIKE or IS_CPU``
(``CUDA_ALIKE`` keeps its meaning). The eligibility rule comes from its one
home, ``patches/rms_norm_forward_cpu/rule.py``: ``cpu_fused_norm_dtypes()``
(per process: the build and the machine) is added and called once, at import,
into ``CPU_DTYPES, CPU_ADD_DTYPES``; each norm's ``supports_args`` lambda gains
``and (not IS_CPU or (<the rule's per-call checks>))``. Every statement the
edit writes comes out as vLLM's ruff lays it out.
"""

from __future__ import annotations

import ast

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


def cpu_guard(op: str, params: list[str]) -> str:
    """``(not IS_CPU or (<the rule's per-call checks>))`` for the norm's
    ``supports_args`` parameters (its tensors first, then the weight)."""
    x, residual = params[0], params[1] if TENSORS[op] > 1 else None
    weight = params[TENSORS[op]]
    checks = call_checks(x, weight, DTYPES[op], residual, weight_may_be_none=True)
    return f"(not {IS_CPU} or ({checks}))"


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
    meaning = lambda c: ast.dump(ast.parse(c.strip(), mode="eval"))  # noqa: E731
    return (
        isinstance(expr, cst.BooleanOperation)
        and isinstance(expr.operator, operator)
        and meaning(source(expr.right)) == meaning(code)
    )


def _at(tree: cst.Module, code: str) -> int | None:
    """The index of the module-level statement whose code is ``code``."""
    return next((i for i, s in enumerate(tree.body) if source(s) == code), None)


def _defined(tree: cst.Module, name: str) -> int | None:
    return next(
        (
            i
            for i, s in enumerate(tree.body)
            if isinstance(s, cst.FunctionDef) and s.name.value == name
        ),
        None,
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
        if len(params) < TENSORS[op] + 1:
            raise self.shape_error(
                f"{op}'s supports_args taking its input tensors, then the weight",
                f"parameters {params}",
            )
        return value, params

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
        f"{NORM_GATE}), where they match native: the eligibility rule's "
        f"{FUNCTION}() once at import, its per-call checks in supports_args."
    )

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        for name in ("current_platform", "torch"):
            if not _uses(tree, name):
                raise self.shape_error(f"{name} imported", "none")
        norms = self.norms(tree)
        edit = _Edit(tree)
        self._gate(tree, norms, edit)
        users = []
        for op, norm in norms.items():
            check, params = self.predicate(tree, op, norm[2])
            named = _keyword(norm[2], "supports_args")
            inline = isinstance(named, cst.Lambda)
            users.append(norm[0] if inline else _assignment(tree, named.value))
            guard = cpu_guard(op, params)
            if not _ends_with(check.body, cst.And, guard):
                body = _and(check.body, cst.parse_expression(guard))
                self.set_predicate(tree, edit, norm, check.with_changes(body=body))
                self.record(
                    f"the {op} impl's `supports_args` takes on CPU only the inputs "
                    f"where the kernel matches native: `and {guard}`"
                )
        cpu = _assignment(tree, IS_CPU)
        if cpu is not None and source(_value(tree, cpu)) != "current_platform.is_cpu()":
            raise self.shape_error(
                f"{IS_CPU} unassigned, or `{IS_CPU_LINE}`", source(tree.body[cpu])
            )
        if not edit.changed():
            return tree
        if cpu is None:
            self._cpu_constant(tree, edit)
        self._dtypes(tree, edit, min(users))
        return edit.result()

    def _dtypes(self, tree, edit: _Edit, first_user: int) -> None:
        """The rule's ``cpu_fused_norm_dtypes()`` and its one call, before the
        first norm predicate or impl."""
        new = []
        if _defined(tree, FUNCTION) is None:
            code = dtypes_function(self.read_tree_file(CPU_PY))
            new.append(cst.parse_statement(code, tree.config_for_parsing))
        if _at(tree, DTYPES_LINES[0]) is None:
            new += [_statement(line, tree) for line in DTYPES_LINES]
        there = edit.inserted.setdefault(first_user, [])
        at = int(bool(there) and source(there[0]) == IS_CPU_LINE)  # after IS_CPU
        there[at:at] = new
        if new:
            self.record(
                f"`{FUNCTION}()` (the dtypes in which the kernels match native on "
                f"this build and machine) is added and called once: "
                f"`{DTYPES_LINES[0]}`"
            )

    def _cpu_constant(self, tree, edit: _Edit) -> None:
        """``IS_CPU`` after the last platform fact (and its docstring)."""
        facts = [i for i, s in enumerate(tree.body) if _platform_fact(s)]
        if not facts:
            raise self.shape_error(
                "constants such as CUDA_ALIKE = current_platform.is_cuda_alike()",
                "none",
            )
        at = facts[-1] + 1
        at += at < len(tree.body) and _docstring(tree.body[at])
        edit.inserted[at] = [_statement(IS_CPU_LINE, tree), *edit.inserted.get(at, ())]
        self.record(f"`{IS_CPU_LINE}` caches the CPU check")

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
        f"supports_args without the CPU checks, and {FUNCTION}(), its call and "
        f"{IS_CPU} where nothing else uses them."
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
            check, params = self.predicate(tree, op, norm[2])
            if _ends_with(check.body, cst.And, cpu_guard(op, params)):
                body = check.body
                left = body.left.with_changes(lpar=body.lpar, rpar=body.rpar)
                self.set_predicate(tree, edit, norm, check.with_changes(body=left))
                self.record(f"the {op} impl's `supports_args` loses its CPU checks")
        if not edit.changed():
            return tree
        left = cst.Module([s for i, s in enumerate(edit.body) if i not in edit.removed])
        call = _at(tree, DTYPES_LINES[0])
        if call is not None and not any(_uses(left, n) > 1 for n in DTYPES.values()):
            edit.removed.add(call)
            if source(tree.body[call + 1]) == DTYPES_LINES[1]:
                edit.removed.add(call + 1)
            defined = _defined(tree, FUNCTION)
            if defined is not None and _uses(left, FUNCTION) == 2:  # def and call
                edit.removed.add(defined)
        cpu = _assignment(tree, IS_CPU)
        left = cst.Module([s for i, s in enumerate(edit.body) if i not in edit.removed])
        if cpu is not None and _uses(left, IS_CPU) == 1:
            edit.removed.add(cpu)
        return edit.result()
