"""Give ``RMSNorm`` a ``forward_cpu`` that calls vLLM's CPU kernels, in
``GELU.forward_cpu``'s idiom (``vllm/model_executor/layers/activation.py``):
the kernel for the inputs it matches native on, ``forward_native`` for the
rest. ``layernorm.py`` gains ``rule.py``'s ``cpu_fused_norm_dtypes()``, a line
in ``RMSNorm.__init__`` and the method. A ``forward_cpu`` that is not this one
is vLLM's own (``VllmHasItsOwn``).
"""

from __future__ import annotations

import textwrap

import libcst as cst

from patcher.codemod import TreeCodemod
from patcher.ruff_format import format_member, format_source
from patches.rms_norm_forward_cpu import rule

CLASS = "RMSNorm"
METHOD = "forward_cpu"
FUNCTION = "cpu_fused_norm_dtypes"


def _def_at(body, name: str) -> int | None:
    found = (i for i, s in enumerate(body) if isinstance(s, cst.FunctionDef))
    return next((i for i in found if body[i].name.value == name), None)


def _same(a: cst.CSTNode, b: cst.CSTNode) -> bool:
    """The same code, whatever the blank lines and comments above it."""
    return a.with_changes(leading_lines=()).deep_equals(
        b.with_changes(leading_lines=())
    )


class _Edit(TreeCodemod):
    def pieces(self, tree: cst.Module) -> tuple:
        """The function, the ``__init__`` lines and the method, laid out for
        this tree, in the release's spelling of batch invariance (by the name
        ``layernorm.py`` imports)."""
        imported = {
            alias.evaluated_alias or alias.evaluated_name
            for stmt in tree.body
            if isinstance(stmt, cst.SimpleStatementLine)
            for small in stmt.body
            if isinstance(small, cst.Import | cst.ImportFrom)
            and not isinstance(small.names, cst.ImportStar)
            for alias in small.names
        }
        spelling = [s for n, s in rule.BATCH_INVARIANT.items() if n in imported]
        if not spelling:
            raise self.shape_error(
                "an import of vllm_is_batch_invariant or vllm.envs",
                "neither is imported",
            )
        code = format_source(rule.dtypes_function(self.read_tree_file(rule.CPU_PY)))
        function = cst.parse_statement(
            code.replace("\n", tree.default_newline), config=tree.config_for_parsing
        )
        init = rule.INIT_LINES.format(batch_invariant=spelling[0])
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
        anchor, init = _def_at(body, "forward_native"), _def_at(body, "__init__")
        if anchor is None or init is None:
            raise self.shape_error(
                f"{CLASS}.__init__ and {CLASS}.forward_native", "missing"
            )
        function, init_lines, method = self.pieces(tree)
        old = body[init].body
        body[init] = body[init].with_changes(
            body=old.with_changes(body=[*old.body, *init_lines])
        )
        blank = cst.EmptyLine(indent=False)
        body.insert(anchor + 1, method.with_changes(leading_lines=[blank]))
        tree = self.with_body(tree, at, cls, body)
        # Above the class and the comments that belong to it.
        comments = [c for c in tree.body[at].leading_lines if c.comment is not None]
        statements = list(tree.body)
        statements[at] = statements[at].with_changes(
            leading_lines=[blank, blank, *comments]
        )
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
            old = body[init].body
            n = len(old.body) - len(tail)
            if n >= 0 and all(map(_same, old.body[n:], tail)):
                body[init] = body[init].with_changes(
                    body=old.with_changes(body=old.body[:n])
                )
        tree = self.with_body(tree, at, cls, body)
        at = _def_at(tree.body, FUNCTION)
        self.record(f"`{CLASS}.{METHOD}` and `{FUNCTION}` are removed")
        if at is None or not _same(tree.body[at], function):
            return tree
        return tree.with_changes(body=[*tree.body[:at], *tree.body[at + 1 :]])
