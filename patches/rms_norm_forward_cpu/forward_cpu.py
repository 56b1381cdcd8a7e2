"""Give ``RMSNorm`` a ``forward_cpu`` that calls vLLM's CPU kernels, in
``GELU.forward_cpu``'s idiom (``vllm/model_executor/layers/activation.py``):
the kernel for the inputs it matches native on, ``forward_native`` for the
rest. ``CustomOp`` decides when it runs (eager: ``custom_ops: ["all"]``; a model
Inductor compiles stays native). ``layernorm.py`` gains ``rule.py``'s
``cpu_fused_norm_dtypes()``, a line in ``RMSNorm.__init__`` and the method. A
``forward_cpu`` that is not this one is vLLM's own (``VllmHasItsOwn``).
"""

from __future__ import annotations

import textwrap

import libcst as cst

from patcher.codemod import TreeCodemod
from patcher.ruff_format import format_member, format_source
from patches.rms_norm_forward_cpu import rule

CLASS = "RMSNorm"
METHOD = "forward_cpu"
AFTER = "forward_native"
FUNCTION = "cpu_fused_norm_dtypes"
CPU_PY = "vllm/platforms/cpu.py"


def _is_def(stmt: cst.CSTNode, name: str) -> bool:
    return isinstance(stmt, cst.FunctionDef) and stmt.name.value == name


def _def_at(body, name: str) -> int | None:
    return next((i for i, s in enumerate(body) if _is_def(s, name)), None)


def batch_invariant(module: cst.Module) -> str | None:
    """The release's spelling of "batch invariance is on", by its imports."""
    imported = {
        alias.evaluated_alias or alias.evaluated_name
        for stmt in module.body
        if isinstance(stmt, cst.SimpleStatementLine)
        for small in stmt.body
        if isinstance(small, cst.Import | cst.ImportFrom)
        and not isinstance(small.names, cst.ImportStar)
        for alias in small.names
    }
    return next((s for n, s in rule.BATCH_INVARIANT.items() if n in imported), None)


def _same(a: cst.CSTNode, b: cst.CSTNode) -> bool:
    """The same code, whatever the blank lines and comments above it."""
    return a.with_changes(leading_lines=()).deep_equals(
        b.with_changes(leading_lines=())
    )


class _Edit(TreeCodemod):
    def pieces(self, tree: cst.Module) -> tuple:
        """The function, the ``__init__`` lines and the method, laid out for
        this tree."""
        spelling = batch_invariant(tree)
        if spelling is None:
            raise self.shape_error(
                "an import of vllm_is_batch_invariant or vllm.envs",
                "neither is imported",
            )
        code = format_source(rule.dtypes_function(self.read_tree_file(CPU_PY)))
        function = cst.parse_statement(
            code.replace("\n", tree.default_newline), config=tree.config_for_parsing
        )
        init = rule.INIT_LINES.format(batch_invariant=spelling)
        init = format_member(f"def _(self):\n{textwrap.indent(init, '    ')}", tree)
        return function, init.body.body, format_member(rule.FORWARD_CPU, tree)

    def ours_at(self, tree: cst.Module, body) -> int | None:
        """Where this tool's forward_cpu is in the class ``body``; None without
        one; vLLM's own (any other) raises ``VllmHasItsOwn``."""
        at = _def_at(body, METHOD)
        if at is not None and not _same(body[at], self.pieces(tree)[2]):
            raise self.vllm_has_its_own(f"vLLM's own {CLASS}.{METHOD}")
        return at


class AddRmsNormForwardCpu(_Edit):
    DESCRIPTION = (
        f"Add {CLASS}.{METHOD}: vLLM's CPU rms_norm and fused_add_rms_norm "
        "kernels where they match forward_native, forward_native for the rest."
    )

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        at, cls = self.top_level_class(tree, CLASS)
        body = list(cls.body.body)
        if self.ours_at(tree, body) is not None:
            return tree  # applied already
        anchor, init = _def_at(body, AFTER), _def_at(body, "__init__")
        if anchor is None or init is None:
            raise self.shape_error(f"{CLASS}.__init__ and {CLASS}.{AFTER}", "missing")
        function, init_lines, method = self.pieces(tree)
        old = body[init]
        body[init] = old.with_changes(
            body=old.body.with_changes(body=[*old.body.body, *init_lines])
        )
        blank = cst.EmptyLine(indent=False)
        body.insert(anchor + 1, method.with_changes(leading_lines=[blank]))
        tree = self.with_body(tree, at, cls, body)
        # Above the class and the comments that belong to it.
        statements = list(tree.body)
        comments = [c for c in statements[at].leading_lines if c.comment is not None]
        lines = [blank, blank, *comments]
        statements[at] = statements[at].with_changes(leading_lines=lines)
        statements.insert(at, function.with_changes(leading_lines=[blank, blank]))
        self.record(
            f"`{CLASS}.{METHOD}` is added, with `{FUNCTION}()` (the dtypes the CPU "
            "kernels match `forward_native` in on this machine, decided once per "
            f"layer in `{CLASS}.__init__`): `ops.rms_norm` and "
            "`ops.fused_add_rms_norm` for contiguous inputs of one such "
            "dtype with a hidden size that is a multiple of 8; `forward_native` "
            "for the rest, a weightless norm, a variance size override and batch "
            "invariance"
        )
        return tree.with_changes(body=statements)


class RemoveRmsNormForwardCpu(_Edit):
    DESCRIPTION = (
        f"Undo AddRmsNormForwardCpu: drop {CLASS}.{METHOD}, its line in "
        f"{CLASS}.__init__ and {FUNCTION}; a {METHOD} that is not this tool's "
        "is vLLM's own and stays."
    )

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        at, cls = self.top_level_class(tree, CLASS)
        body = list(cls.body.body)
        mine = self.ours_at(tree, body)
        if mine is None:
            return tree
        function, tail, _ = self.pieces(tree)
        del body[mine]
        init = _def_at(body, "__init__")
        if init is not None:
            stmts = list(body[init].body.body)
            n = len(tail)
            if len(stmts) >= n and all(map(_same, stmts[len(stmts) - n :], tail)):
                stmts = stmts[: len(stmts) - n]
            body[init] = body[init].with_changes(
                body=body[init].body.with_changes(body=stmts)
            )
        tree = self.with_body(tree, at, cls, body)
        statements = [
            s for s in tree.body if not (_is_def(s, FUNCTION) and _same(s, function))
        ]
        self.record(f"`{CLASS}.{METHOD}` and `{FUNCTION}` are removed")
        return tree.with_changes(body=statements)
