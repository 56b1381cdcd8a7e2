"""Mark the "vllm_c" RMSNorm implementations supported on CPU.

The rule: on CPU, exactly ``rms_norm`` and ``fused_add_rms_norm`` change; on
every other platform, and for every other op, nothing changes.

vLLM's CPU build ships ``torch.ops._C.rms_norm`` and ``fused_add_rms_norm``,
but ``vllm/kernels/vllm_c.py`` gates their IR implementations on GPU-like
platforms. The file caches platform facts as module constants (``CUDA_ALIKE``,
``IS_ROCM``), so the CPU check becomes one more, ``IS_CPU =
current_platform.is_cpu()`` (with its docstring) after the last of them, and
the gate gains ``or IS_CPU``:

* ``GPGPU_DEVICE = CUDA_ALIKE or current_platform.is_xpu()`` (0.27 and later)
  is widened, as upstream does, only when the two norms are its only users;
* otherwise (``supported=CUDA_ALIKE`` in 0.20 to 0.26, or a ``GPGPU_DEVICE``
  that also gates ``silu_and_mul``) the norms' own ``supported=`` arguments
  name a new gate, because the shared name also gates kernels the CPU build
  lacks;
* a norm whose gate already admits CPU keeps it as it is.

Whether a gate admits CPU is evaluated, not searched for: ``or not
current_platform.is_cpu()`` mentions CPU but excludes it.

The CPU kernels ignore strides: on a non-contiguous input (a q/k slice of a
fused qkv projection, a transposed view) they return wrong numbers without an
error. So each norm's ``supports_args`` (a lambda or a ``def`` returning one
expression, with whatever parameter names it has) also gains ``and (not IS_CPU
or x.is_contiguous())`` for its input tensors (the input, and the residual for
the fused add), which sends such calls to the native implementation on CPU and
changes nothing elsewhere; its docstring gains the sentence that says so.

Each statement the edit touches comes out as vLLM's ruff lays it out, also
where the tree did not have it that way (a fork formatted otherwise): every
line the edit writes is ruff's. The revert finds the layout that apply started
from where apply kept it, and proves it by applying again; where apply
reformatted a statement the engine reverts from its backup.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext

from patcher.codemod import CHANGES, TreeCodemod
from patcher.docstrings import docstring_of, with_sentence, without_sentence
from patcher.errors import ShapeNotRecognised
from patcher.ruff_format import format_node
from patcher.statements import (
    drop_at,
    holds,
    insert_at,
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
    CPU_CONSTANT,
    CPU_CONSTANT_DOC,
    CPU_CONSTANT_SOURCE,
    ENDS_WITH_IS_CPU_OR,
    IS_CPU,
    IS_CPU_SOURCE,
    NORM_OPS,
    NORM_TENSORS,
    PLATFORM_CALL,
    VllmCImpl,
    admits,
    contiguity_sentence,
    cpu_guard,
    module_assignments,
    name_counts,
    vllm_c_impls,
)

GATE = "GPGPU_DEVICE"
# The norms' own gate, where GPGPU_DEVICE or CUDA_ALIKE also gates other impls.
NORM_GATE = "RMS_NORM_DEVICE"
# A module constant caching a platform fact: ``IS_ROCM = current_platform.is_rocm()``.
PLATFORM_FACT = m.SimpleStatementLine(
    [m.Assign([m.AssignTarget(m.Name())], value=PLATFORM_CALL)]
)
CPU_FACT = m.SimpleStatementLine(
    [m.Assign([m.AssignTarget(m.Name(CPU_CONSTANT))], value=IS_CPU)]
)


@dataclass(frozen=True)
class Predicate:
    """A norm's ``supports_args``: the expression it returns and its tensors."""

    name: str | None
    """The module-level name it is bound to, or None when written inline."""
    body: cst.BaseExpression
    tensors: tuple[str, ...]
    """Its own names for the input tensors (the input, and the residual)."""
    doc: cst.SimpleString | None = None
    """Its docstring: the string after its assignment, or its ``def``'s own."""
    doc_indent: str = ""
    """The indentation of the docstring's lines (a ``def``'s body's)."""


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
    docs: dict[cst.SimpleString, cst.SimpleString]
    """Docstrings replaced as they are (not reformatted: ruff keeps them)."""

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
        doc, indent = _docstring(value, name, tree)
        return Predicate(name, body, tuple(names[:count]), doc, indent)

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
        if original_node in self.docs:
            return self.docs[original_node]
        edit = self.edits.get(original_node)
        return edit(updated_node) if edit else updated_node


class EnableVllmCOnCpu(_NormCodemod):
    DESCRIPTION = (
        'Mark the "vllm_c" RMSNorm kernels supported on CPU '
        f"({CPU_CONSTANT_SOURCE} beside the module's other platform facts; "
        f"{GATE} gains `or {CPU_CONSTANT}` when only the norms use it, else the "
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
        self.edits, self.docs = {}, {}
        self.first_said = len(self.context.scratch.get(CHANGES, ()))
        own = [i for i in norms if self._gate(i, tree, norms, assignments)]
        new_gate = self._own_gate(own, tree, assignments) if own else None
        for impl in norms:
            self._guard(impl, tree, assignments)
        if not self.edits:
            return tree
        # Every statement the edit touches comes out as vLLM's ruff lays it out,
        # also where the tree had it otherwise: so does every line it writes.
        for at in units_holding(tree, self.edits):
            unit = unit_at(tree, at)
            edit = self.edits.get(unit)
            self.edits[unit] = lambda n, e=edit: format_node(e(n) if e else n, tree)
        users = [at[0] for at in units_holding(tree, self.edits)]
        users += [new_gate[0]] if new_gate is not None else []
        constant = self._cpu_constant(tree, assignments, min(users))
        result = tree.visit(self)
        if new_gate is not None:
            result = insert_before(result, *new_gate)
        if constant is not None:
            at, after_facts = constant
            insert = insert_at if after_facts else insert_before
            result = insert(result, at, *_cpu_constant_statements(tree))
        return result

    def _cpu_constant(self, tree, assignments, first_user: int):
        """Where ``IS_CPU`` goes, before ``tree.body[first_user]`` (its first
        user): (index, True) right after the last platform fact above it and
        that fact's docstring; (index, False) before the first user where there
        is none; None where the module has it already."""
        value = assignments.get(CPU_CONSTANT)
        if value is not None:
            defined = [i for i, s in enumerate(tree.body) if m.matches(s, CPU_FACT)]
            if not defined or defined[0] > first_user:
                raise self.shape_error(
                    looked_for=f"{CPU_CONSTANT} unassigned, or `{CPU_CONSTANT_SOURCE}` "
                    "before its first use",
                    found=f"{CPU_CONSTANT} = {_source(value)}",
                )
            return None
        # Said first: the sentences after it use the name.
        said = self.context.scratch.setdefault(CHANGES, [])
        said.insert(
            self.first_said,
            f"`{CPU_CONSTANT_SOURCE}` caches the CPU check beside the module's "
            "other platform facts",
        )
        facts = [
            i
            for i, stmt in enumerate(tree.body[:first_user])
            if m.matches(stmt, PLATFORM_FACT)
        ]
        if not facts:
            return first_user, False
        at = facts[-1] + 1
        if at < first_user and docstring_of(tree.body, at) is not None:
            at += 1
        return at, True

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
                f"`{GATE}` gains `or {CPU_CONSTANT}`: it gates only the "
                f"`vllm_c` {_ops(ops)} impls"
            )
        self._append(target, cst.Or, cst.Name(CPU_CONSTANT))
        return False

    def _own_gate(self, own: list[VllmCImpl], tree, assignments):
        """``RMS_NORM_DEVICE = <their gate> or IS_CPU`` before
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
                f"{NORM_GATE} = {_source(gate)} or {CPU_CONSTANT}\n",
                config=tree.config_for_parsing,
            ),
            tree,
        )
        users = self._gate_users(own[0].supported, tree)
        also = f", which also gates {_ops(users)}," if users else ""
        self.record(
            f"{_impls([i.op for i in own])} "
            f"`supported={_source(own[0].supported)}` becomes `{NORM_GATE}`, a new "
            f"name for `{_source(gate)} or {CPU_CONSTANT}` "
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
        if _ends_with_guard(check.body, check.tensors) or check.body in self.edits:
            return
        guard = cpu_guard(check.tensors)
        tensors = _ops([f"`{t}`" for t in check.tensors])
        where = f"`{check.name}`" if check.name else "the inline lambda"
        said = self._document(check)
        self.record(
            f"{where}, the {impl.op} impl's `supports_args`, refuses a "
            f"non-contiguous {tensors} on CPU: `and {_source(guard)}`{said}"
        )
        self._append(check.body, cst.And, guard)

    def _document(self, check: Predicate) -> str:
        """The predicate's docstring gains its CPU requirement; what to add to
        the record of it."""
        sentence = contiguity_sentence(check.tensors)
        doc = check.doc
        if doc is None or without_sentence(doc.value, sentence) is not None:
            return ""
        column = len(check.doc_indent)
        new = with_sentence(doc.value, sentence, column, check.doc_indent)
        if new is None:
            return ""
        self.docs[doc] = doc.with_changes(value=new)
        return f'; its docstring adds "{sentence}"'

    def _append(self, target, operator: type[cst.BaseBooleanOp], operand) -> None:
        if not can_append(target, operator):
            raise self.shape_error(
                looked_for=f"an operand to extend: `... {operator.__name__.lower()} X`",
                found=_source(target),
            )
        self.edits.setdefault(target, lambda n: append_operand(n, operator, operand))


def _after_fact(tree: cst.Module, at: int) -> bool:
    """Whether ``tree.body[at]`` follows a platform fact (or its docstring)."""
    before = [s for s in tree.body[max(at - 2, 0) : at]]
    return any(m.matches(s, PLATFORM_FACT) for s in before)


def _cpu_constant_statements(tree: cst.Module) -> list[cst.BaseStatement]:
    """``IS_CPU = current_platform.is_cpu()`` and its docstring."""
    nl = tree.default_newline
    return [
        cst.parse_statement(line + nl, config=tree.config_for_parsing)
        for line in (CPU_CONSTANT_SOURCE, CPU_CONSTANT_DOC)
    ]


def _docstring(value: cst.CSTNode, name: str | None, tree: cst.Module):
    """A predicate's docstring and its lines' indentation: a ``def``'s own, or
    the string right after the statement binding ``name`` to a lambda."""
    if isinstance(value, cst.FunctionDef):
        return docstring_of(value.body.body, 0), tree.default_indent
    binds = m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name(name or ""))])])
    found = [i for i, stmt in enumerate(tree.body) if m.matches(stmt, binds)]
    return (docstring_of(tree.body, found[0] + 1) if found else None), ""


def _ends_with_guard(body: cst.BaseExpression, tensors) -> bool:
    """Whether ``body`` ends with the contiguity guard (``IS_CPU``, or the
    ``current_platform.is_cpu()`` call earlier versions of this edit wrote)."""
    return m.matches(body, m.BooleanOperation(operator=m.And())) and any(
        _same_code(body.right, cpu_guard(tensors, check))
        for check in (CPU_CONSTANT, IS_CPU_SOURCE)
    )


class DisableVllmCOnCpu(_NormCodemod):
    DESCRIPTION = (
        "Undo EnableVllmCOnCpu: drop the CPU gate, the contiguity check and its "
        f"sentence, and {CPU_CONSTANT} where nothing else uses it."
    )

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        assignments = module_assignments(tree)
        norms = self.norms(tree)
        self.edits, self.docs = {}, {}
        own_gate = self._own_gate(tree, norms, assignments)
        for impl in norms:
            gate = impl.supported
            if self.widens_gate(impl, tree, norms, assignments):
                gate = assignments[GATE]
            self._strip_gate(gate, assignments)
            self._strip_guard(impl, tree, assignments)
        if not self.edits:
            return tree
        units = units_holding(tree, self.edits)
        stripped = tree.visit(self)
        removed = {own_gate: 1} if own_gate is not None else {}
        going = [] if own_gate is None else [tree.body[own_gate]]
        constant = self._unused_constant(tree, stripped, going)
        if constant is not None:
            removed[constant] = 2
        for at in sorted(removed, reverse=True):
            if at == own_gate:
                stripped = remove_at(stripped, at)
            elif tree.body[at].leading_lines or not _after_fact(tree, at):
                stripped = remove_at(stripped, at, 2)
            else:
                stripped = drop_at(stripped, at, 2)
        return self._layout(tree, stripped, units, removed)

    def _strip_guard(self, impl: VllmCImpl, tree, assignments) -> None:
        check = self.predicate(impl, tree, assignments)
        if not _ends_with_guard(check.body, check.tensors):
            return
        self.edits[check.body] = strip_operand
        self.record(f"the CPU contiguity check of {impl.op} is removed")
        sentence = contiguity_sentence(check.tensors)
        old = check.doc and without_sentence(check.doc.value, sentence)
        if old:
            self.docs[check.doc] = check.doc.with_changes(value=old)

    def _unused_constant(self, tree, stripped: cst.Module, going) -> int | None:
        """Where apply's ``IS_CPU`` statement is, if nothing but it and the
        ``going`` statements uses it any more."""
        uses = sum(len(m.findall(s, m.Name(CPU_CONSTANT))) for s in going)
        if name_counts(stripped)[CPU_CONSTANT] - uses != 1:
            return None
        code = tree.code_for_node
        for i, stmt in enumerate(tree.body[:-2]):
            if m.matches(stmt, CPU_FACT):
                doc = tree.body[i + 1].with_changes(leading_lines=[])
                return i if code(doc).strip() == CPU_CONSTANT_DOC else None
        return None

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
        """Only an ``or IS_CPU`` that apply would add again:
        the last operand, of a gate that without it excludes CPU."""
        if gate in self.edits or not m.matches(gate, ENDS_WITH_IS_CPU_OR):
            return
        if not self.admits_cpu(strip_operand(gate), assignments):
            self.edits[gate] = strip_operand
            self.record(f"`{_source(gate)}` loses `or {_source(gate.right)}`")

    def _layout(self, patched: cst.Module, stripped: cst.Module, units, removed):
        """Each edited statement in the layout apply started from: the one that,
        applied again, gives the patched statement back (ruff's, or the tree's
        own where apply kept it). Apply again proves it. ``removed``: how many
        statements went at each place of ``patched``."""

        def there(at):  # the unit's place in ``stripped``
            moved = sum(n for r, n in removed.items() if r < at[0])
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
