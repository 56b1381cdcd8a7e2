"""Mark the "vllm_c" RMSNorm implementations supported on CPU.

The rule: on CPU, exactly ``rms_norm`` and ``fused_add_rms_norm`` change; on
every other platform, and for every other op, nothing changes.

vLLM's CPU build ships ``torch.ops._C.rms_norm`` and ``fused_add_rms_norm``,
but ``vllm/kernels/vllm_c.py`` gates their IR implementations on GPU-like
platforms. The gate gains ``or current_platform.is_cpu()``:

* ``GPGPU_DEVICE = CUDA_ALIKE or current_platform.is_xpu()`` (0.27 and later)
  is widened, as upstream does, only when the two norms are its only users;
* otherwise (``supported=CUDA_ALIKE`` in 0.20 to 0.26, or a ``GPGPU_DEVICE``
  that also gates ``silu_and_mul``) the norms' own ``supported=`` arguments
  gain it, because the shared name also gates kernels the CPU build lacks;
* a norm whose gate already admits CPU keeps it as it is.

Whether a gate admits CPU is evaluated, not searched for: ``or not
current_platform.is_cpu()`` mentions CPU but excludes it.

The CPU kernels ignore strides: on a non-contiguous input (a q/k slice of a
fused qkv projection, a transposed view) they return wrong numbers without an
error. So each norm's ``supports_args`` (a lambda or a ``def`` returning one
expression, with whatever parameter names it has) also gains
``and (not current_platform.is_cpu() or x.is_contiguous())`` for its input
tensors (the input, and the residual for the fused add), which sends such calls
to the native implementation on CPU and changes nothing elsewhere.

Each statement the edit touches comes out as vLLM's ruff lays it out when the
tree had it that way; the revert finds the layout that apply started from and
proves it by applying again.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext

from patcher.codemod import TreeCodemod
from patcher.errors import ShapeNotRecognised
from patcher.ruff_format import format_node, is_formatted
from patcher.statements import (
    holds,
    insert_before,
    remove_at,
    unit_at,
    units_holding,
    with_unit,
)
from patches.cpu_fused_norms.bool_operand import (
    append_operand,
    can_append,
    strip_operand,
)
from patches.cpu_fused_norms.vllm_c_source import (
    ENDS_WITH_IS_CPU_OR,
    IS_CPU_SOURCE,
    NORM_OPS,
    NORM_TENSORS,
    VllmCImpl,
    admits,
    cpu_guard,
    module_assignments,
    name_counts,
    vllm_c_impls,
)

GATE = "GPGPU_DEVICE"
# The norms' own gate, where GPGPU_DEVICE or CUDA_ALIKE also gates other impls.
NORM_GATE = "RMS_NORM_DEVICE"


@dataclass(frozen=True)
class Predicate:
    """A norm's ``supports_args``: the expression it returns and its tensors."""

    name: str | None
    """The module-level name it is bound to, or None when written inline."""
    body: cst.BaseExpression
    tensors: tuple[str, ...]
    """Its own names for the input tensors (the input, and the residual)."""


def _source(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node).strip()


def _same_code(a: cst.CSTNode, b: cst.CSTNode) -> bool:
    """Equal as Python, whatever the layout."""
    dump = lambda n: ast.dump(ast.parse(f"({_source(n)})", mode="eval"))  # noqa: E731
    return dump(a) == dump(b)


def _describe(impls: list[VllmCImpl]) -> str:
    if not impls:
        return 'no @ir.ops.<op>.register_impl("vllm_c", ...) at all'
    return "vllm_c impls for " + ", ".join(i.op for i in impls)


def _ops(ops: list[str]) -> str:
    return " and ".join(", ".join(ops).rsplit(", ", 1))


def _impls(ops: list[str]) -> str:
    """``the `vllm_c` rms_norm impl's``, or ``... impls'`` for several."""
    ending = "s'" if len(ops) > 1 else "'s"
    return f"the `vllm_c` {_ops(ops)} impl{ending}"


class _NormCodemod(TreeCodemod):
    """Finds the norm impls' gates and argument checks; subclasses edit them."""

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

    def admits_cpu(self, gate: cst.BaseExpression, assignments: dict) -> bool:
        """Whether ``gate`` is surely true on CPU. A gate that depends on more
        than ``current_platform.is_*()`` (a flag, a call) counts as not: it gains
        ``or current_platform.is_cpu()``, which changes nothing elsewhere."""
        return admits(gate, "cpu", assignments) is True

    def shared_gate_users(self, tree: cst.Module, norms: list[VllmCImpl]) -> list:
        """What else than the norms' ``supported=`` names ``GPGPU_DEVICE``: the
        other impls' ops, and "other code" for any other use."""
        refs = name_counts(tree)[GATE] - 1  # less its assignment
        by_norms = sum(m.matches(i.supported, m.Name(GATE)) for i in norms)
        others = [
            i.op
            for i in vllm_c_impls(tree)
            if i.op not in NORM_OPS
            and i.supported is not None
            and m.findall(i.supported, m.Name(GATE))
        ]
        if refs - by_norms > len(others):
            others.append("other code")
        return others

    def widens_gate(self, impl: VllmCImpl, tree, norms, assignments) -> bool:
        """Whether the norm's gate is ``GPGPU_DEVICE`` and only the norms use it."""
        return (
            m.matches(impl.supported, m.Name(GATE))
            and GATE in assignments
            and not self.shared_gate_users(tree, norms)
        )

    def predicate(self, impl: VllmCImpl, tree: cst.Module, assignments) -> Predicate:
        """The norm's ``supports_args``: a lambda (inline or a module-level
        name) or a module-level ``def`` that returns one expression."""
        value, name = impl.supports_args, None
        if isinstance(value, cst.Name):
            name = value.value
            functions = {
                s.name.value: s for s in tree.body if isinstance(s, cst.FunctionDef)
            }
            value = assignments.get(name) or functions.get(name) or value
        if isinstance(value, cst.Lambda):
            params, body = value.params, value.body
        elif isinstance(value, cst.FunctionDef):
            params, body = value.params, self._returned(value, impl)
        else:
            raise self.shape_error(
                looked_for=f"a lambda or def as the {impl.op} impl's supports_args",
                found=_source(value),
            )
        names = [p.name.value for p in (*params.posonly_params, *params.params)]
        count = NORM_TENSORS[impl.op]
        if len(names) < count:
            raise self.shape_error(
                looked_for=f"{impl.op}'s supports_args taking its {count} input "
                "tensor(s) first",
                found=f"parameters {names}",
            )
        self._not_shared(impl, name, tree, assignments)
        return Predicate(name, body, tuple(names[:count]))

    def _returned(self, func: cst.FunctionDef, impl: VllmCImpl) -> cst.BaseExpression:
        body = list(func.body.body)
        if body and m.matches(
            body[0], m.SimpleStatementLine([m.Expr(m.SimpleString())])
        ):
            body = body[1:]  # the docstring
        if len(body) == 1 and m.matches(
            body[0], m.SimpleStatementLine([m.Return(value=m.DoNotCare())])
        ):
            returned = body[0].body[0].value
            if returned is not None:
                return returned
        raise self.shape_error(
            looked_for=f"def {func.name.value} (the {impl.op} impl's supports_args) "
            "returning one expression",
            found=f"a body of {len(body)} statement(s)",
        )

    def _not_shared(self, impl, name: str | None, tree, assignments) -> None:
        """A guard on a check another impl supported on CPU shares would change
        that op on CPU too."""
        if name is None:
            return
        sharing = [
            i.op
            for i in vllm_c_impls(tree)
            if i.op not in NORM_OPS
            and m.matches(i.supports_args, m.Name(name))
            and i.supported is not None
            and admits(i.supported, "cpu", assignments) is not False
        ]
        if sharing:
            raise self.shape_error(
                looked_for=f"a supports_args for {impl.op} that no impl supported "
                "on CPU shares",
                found=f"{name} is also the supports_args of {', '.join(sharing)}",
            )

    def on_leave(self, original_node, updated_node):
        updated_node = super().on_leave(original_node, updated_node)
        edit = self.edits.get(original_node)
        return edit(updated_node) if edit else updated_node


class EnableVllmCOnCpu(_NormCodemod):
    DESCRIPTION = (
        'Mark the "vllm_c" RMSNorm kernels supported on CPU '
        f"({GATE} gains {IS_CPU_SOURCE} when only the norms use it, else the "
        f"norms get a gate of their own, {NORM_GATE}), for contiguous inputs "
        "(the CPU kernels ignore strides)."
    )

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        if not name_counts(tree)["current_platform"]:
            raise self.shape_error(
                looked_for="current_platform imported from vllm.platforms",
                found="no current_platform in the module",
            )
        assignments = module_assignments(tree)
        norms = self.norms(tree)
        self.edits = {}
        own = [i for i in norms if self._gate(i, tree, norms, assignments)]
        new_gate = self._own_gate(own, tree, assignments) if own else None
        for impl in norms:
            self._guard(impl, tree, assignments)
        # Statements vLLM's ruff would leave alone come out as it lays them out.
        for at in units_holding(tree, self.edits):
            unit = unit_at(tree, at)
            if is_formatted(unit, tree):
                edit = self.edits.get(unit)
                self.edits[unit] = lambda n, e=edit: format_node(e(n) if e else n, tree)
        result = tree.visit(self)
        if new_gate is not None:
            result = insert_before(result, *new_gate)
        return result

    def _gate(self, impl: VllmCImpl, tree, norms, assignments) -> bool:
        """Widen the norm's gate if it is the norms' own ``GPGPU_DEVICE``; True
        when the norm needs a gate of its own instead."""
        if self.admits_cpu(impl.supported, assignments):
            return False
        if not self.widens_gate(impl, tree, norms, assignments):
            return True
        target = assignments[GATE]
        if target not in self.edits:
            ops = [i.op for i in norms if m.matches(i.supported, m.Name(GATE))]
            self.record(
                f"`{GATE}` gains `or {IS_CPU_SOURCE}`: it gates only the "
                f"`vllm_c` {_ops(ops)} impls"
            )
        self._append(target, cst.Or, cst.parse_expression(IS_CPU_SOURCE))
        return False

    def _own_gate(self, own: list[VllmCImpl], tree, assignments):
        """``RMS_NORM_DEVICE = <their gate> or current_platform.is_cpu()`` before
        the first of them, and their ``supported=`` names it: the shared gate
        stays as it is for everything else it gates."""
        gate = own[0].supported
        differ = [i.op for i in own if not _same_code(i.supported, gate)]
        if differ or NORM_GATE in assignments:
            raise self.shape_error(
                looked_for=f"norms sharing one gate, and no {NORM_GATE} yet",
                found=f"{NORM_GATE} already assigned"
                if NORM_GATE in assignments
                else ", ".join(f"{i.op}: {_source(i.supported)}" for i in own),
            )
        if not can_append(gate, cst.Or):
            gate = gate.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        for impl in own:
            self.edits[impl.supported] = lambda _: cst.Name(NORM_GATE)
        statement = format_node(
            cst.parse_statement(
                f"{NORM_GATE} = {_source(gate)} or {IS_CPU_SOURCE}\n",
                config=tree.config_for_parsing,
            ),
            tree,
        )
        users = self._gate_users(own[0].supported, tree)
        also = f", which also gates {_ops(users)}," if users else ""
        self.record(
            f"{_impls([i.op for i in own])} "
            f"`supported={_source(own[0].supported)}` becomes `{NORM_GATE}`, a new "
            f"name for `{_source(gate)} or {IS_CPU_SOURCE}` "
            f"(`{_source(own[0].supported)}`{also} stays as it is)"
        )
        gates = {impl.supported for impl in own}
        first = next(i for i, stmt in enumerate(tree.body) if holds(stmt, gates))
        return first, statement

    def _gate_users(self, gate: cst.BaseExpression, tree) -> list[str]:
        names = {n.value for n in m.findall(gate, m.Name())}
        return [
            i.op
            for i in vllm_c_impls(tree)
            if i.op not in NORM_OPS
            and i.supported is not None
            and names & {n.value for n in m.findall(i.supported, m.Name())}
        ]

    def _guard(self, impl: VllmCImpl, tree, assignments) -> None:
        check = self.predicate(impl, tree, assignments)
        guard = cpu_guard(check.tensors)
        if _ends_with_guard(check.body, guard) or check.body in self.edits:
            return
        tensors = _ops([f"`{t}`" for t in check.tensors])
        where = f"`{check.name}`" if check.name else "the inline lambda"
        self.record(
            f"{where}, the {impl.op} impl's `supports_args`, refuses a "
            f"non-contiguous {tensors} on CPU: `and {_source(guard)}`"
        )
        self._append(check.body, cst.And, guard)

    def _append(self, target, operator: type[cst.BaseBooleanOp], operand) -> None:
        if not can_append(target, operator):
            raise self.shape_error(
                looked_for=f"an operand to extend: `... {operator.__name__.lower()} X`",
                found=_source(target),
            )
        self.edits.setdefault(target, lambda n: append_operand(n, operator, operand))


def _ends_with_guard(body: cst.BaseExpression, guard: cst.BaseExpression) -> bool:
    return m.matches(body, m.BooleanOperation(operator=m.And())) and _same_code(
        body.right, guard
    )


class DisableVllmCOnCpu(_NormCodemod):
    DESCRIPTION = "Undo EnableVllmCOnCpu: drop the CPU gate and contiguity check."

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        assignments = module_assignments(tree)
        norms = self.norms(tree)
        self.edits = {}
        own_gate = self._own_gate(tree, norms, assignments)
        for impl in norms:
            gate = impl.supported
            if self.widens_gate(impl, tree, norms, assignments):
                gate = assignments[GATE]
            self._strip_gate(gate, assignments)
            check = self.predicate(impl, tree, assignments)
            if _ends_with_guard(check.body, cpu_guard(check.tensors)):
                self.edits[check.body] = strip_operand
                self.record(f"the CPU contiguity check of {impl.op} is removed")
        if not self.edits:
            return tree
        units = units_holding(tree, self.edits)
        stripped = tree.visit(self)
        if own_gate is not None:
            stripped = remove_at(stripped, own_gate)
        return self._layout(tree, stripped, units, own_gate)

    def _own_gate(self, tree, norms, assignments) -> int | None:
        """Where apply's ``RMS_NORM_DEVICE`` statement is, if the norms use it
        and nothing else does; their ``supported=`` get its old gate back."""
        value = assignments.get(NORM_GATE)
        users = [i for i in norms if m.matches(i.supported, m.Name(NORM_GATE))]
        refs = name_counts(tree)[NORM_GATE] - 1
        if (
            value is None
            or not users
            or refs != len(users)
            or not m.matches(value, ENDS_WITH_IS_CPU_OR)
            or self.admits_cpu(value.left, assignments)
        ):
            return None
        gate = value.left
        if gate.lpar and not m.matches(gate, m.Name()):
            gate = gate.with_changes(lpar=[], rpar=[])
        for impl in users:
            self.edits[impl.supported] = lambda _, g=gate: g
        self.record(
            f"{_impls([i.op for i in users])} `supported=` "
            f"goes back to `{_source(gate)}`; `{NORM_GATE}` is removed"
        )
        return next(
            i
            for i, stmt in enumerate(tree.body)
            if m.matches(
                stmt,
                m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name(NORM_GATE))])]),
            )
        )

    def _strip_gate(self, gate: cst.BaseExpression, assignments: dict) -> None:
        """Only an ``or current_platform.is_cpu()`` that apply would add again:
        the last operand, of a gate that without it excludes CPU."""
        if gate in self.edits or not m.matches(gate, ENDS_WITH_IS_CPU_OR):
            return
        if not self.admits_cpu(strip_operand(gate), assignments):
            self.edits[gate] = strip_operand
            self.record(f"`{_source(gate)}` loses `or {IS_CPU_SOURCE}`")

    def _layout(self, patched: cst.Module, stripped: cst.Module, units, removed):
        """Each edited statement in the layout apply started from: the one that,
        applied again, gives the patched statement back (ruff's, or the tree's
        own where apply kept it). Apply again proves it."""

        def there(at):  # the unit's place in ``stripped``
            moved = removed is not None and at[0] > removed
            return (at[0] - moved, at[1])

        pending = {
            at: [
                format_node(unit_at(stripped, there(at)), stripped),
                unit_at(stripped, there(at)),
            ]
            for at in units
        }
        result = stripped
        while pending:
            trial = stripped
            for at, candidates in pending.items():
                trial = with_unit(trial, there(at), candidates[0])
            try:
                again = EnableVllmCOnCpu(CodemodContext()).transform_module(trial)
            except ShapeNotRecognised:
                again = None
            for at in list(pending):
                code = patched.code_for_node
                if again is not None and code(again.body[at[0]]) == code(
                    patched.body[at[0]]
                ):
                    result = with_unit(result, there(at), pending.pop(at)[0])
                    continue
                pending[at].pop(0)
                if not pending[at]:
                    raise self.shape_error(
                        looked_for="a statement as apply lays it out",
                        found=code(patched.body[at[0]]).strip(),
                    )
        return result
