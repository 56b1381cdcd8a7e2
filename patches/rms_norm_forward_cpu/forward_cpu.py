"""Give ``RMSNorm`` a ``forward_cpu`` that calls vLLM's CPU kernels.

vLLM's ``CustomOp`` dispatch calls ``forward_cpu`` on CPU for an enabled op;
``CustomOp.forward_cpu`` falls back to ``forward_native``, and ``RMSNorm``
defines none, so on CPU every norm runs the PyTorch form although the CPU build
ships ``torch.ops._C.rms_norm`` and ``fused_add_rms_norm``. The method added
here is ``GELU.forward_cpu``'s idiom (``vllm/model_executor/layers/activation.py``):
the kernel for the inputs it handles, ``forward_native`` for the rest. Whether it
runs is vLLM's own rule, decided on the final compilation config: custom ops are
enabled when not compiling with Inductor (``custom_ops: ["all"]``) and disabled
when Inductor compiles (``["none"]``: native, which Inductor fuses), and
``+rms_norm`` / ``-rms_norm`` override it. Where the kernels run is
``rule.py``'s: ``layernorm.py`` gains its ``cpu_fused_norm_dtypes()``, a line
in ``RMSNorm.__init__`` and ``RMSNorm.forward_cpu``. A ``forward_cpu`` that is
not this one is vLLM's own: both codemods raise ``VllmHasItsOwn``, and
``apply`` and ``revert`` leave the file as it is.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from patcher.codemod import TreeCodemod
from patcher.ruff_format import format_member, format_source
from patches.rms_norm_forward_cpu import rule

CLASS = "RMSNorm"
METHOD = "forward_cpu"
AFTER = "forward_native"
FUNCTION = "cpu_fused_norm_dtypes"
CPU_PY = "vllm/platforms/cpu.py"

NAMED = m.FunctionDef(name=m.Name(METHOD))
ANCHOR = m.FunctionDef(name=m.Name(AFTER))
INIT = m.FunctionDef(name=m.Name("__init__"))
DTYPES_DEF = m.FunctionDef(name=m.Name(FUNCTION))


def _imported_names(module: cst.Module) -> set[str]:
    """The names the module's top-level imports bind."""
    return {
        alias.evaluated_alias or alias.evaluated_name
        for stmt in module.body
        if isinstance(stmt, cst.SimpleStatementLine)
        for small in stmt.body
        if isinstance(small, (cst.Import, cst.ImportFrom))
        and not isinstance(small.names, cst.ImportStar)
        for alias in small.names
    }


def batch_invariant(module: cst.Module) -> str | None:
    """The release's spelling of "batch invariance is on", by its imports."""
    imported = _imported_names(module)
    return next((s for n, s in rule.BATCH_INVARIANT.items() if n in imported), None)


class _Edit(TreeCodemod):
    """What both directions share: the three pieces, laid out for this tree."""

    def pieces(self, tree: cst.Module) -> tuple[cst.BaseStatement, ...]:
        spelling = batch_invariant(tree)
        if spelling is None:
            raise self.shape_error(
                "an import of vllm_is_batch_invariant or vllm.envs",
                "neither is imported",
            )
        nl = tree.default_newline
        function = cst.parse_statement(
            format_source(rule.dtypes_function(self.read_tree_file(CPU_PY))).replace(
                "\n", nl
            ),
            config=tree.config_for_parsing,
        )
        init = rule.INIT_LINES.format(batch_invariant=spelling)
        init_lines = format_member(
            f"def _(self):\n{rule.indented(init)}", tree
        ).body.body
        return function, init_lines, format_member(rule.FORWARD_CPU, tree)

    def ours_at(self, tree: cst.Module, body) -> int | None:
        """Where this tool's forward_cpu is in the class ``body``; None without
        one; vLLM's own (any other) raises ``VllmHasItsOwn``."""
        found = [i for i, s in enumerate(body) if m.matches(s, NAMED)]
        if not found:
            return None
        if not _same(body[found[0]], self.pieces(tree)[2]):
            raise self.vllm_has_its_own(f"vLLM's own {CLASS}.{METHOD}")
        return found[0]


def _same(a: cst.CSTNode, b: cst.CSTNode) -> bool:
    """The same code, whatever the blank lines and comments above it."""
    return a.with_changes(leading_lines=()).deep_equals(
        b.with_changes(leading_lines=())
    )


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
        anchors = [i for i, s in enumerate(body) if m.matches(s, ANCHOR)]
        inits = [i for i, s in enumerate(body) if m.matches(s, INIT)]
        if not anchors or not inits:
            raise self.shape_error(f"{CLASS}.__init__ and {CLASS}.{AFTER}", "missing")
        function, init_lines, method = self.pieces(tree)
        init = body[inits[0]]
        body[inits[0]] = init.with_changes(
            body=init.body.with_changes(body=[*init.body.body, *init_lines])
        )
        blank = [cst.EmptyLine(indent=False)]
        body.insert(anchors[0] + 1, method.with_changes(leading_lines=blank))
        tree = self.with_body(tree, at, cls, body)
        # Above the class and the comments that belong to it.
        two_blank = [cst.EmptyLine(indent=False)] * 2
        statements = list(tree.body)
        comments = [c for c in statements[at].leading_lines if c.comment is not None]
        statements[at] = statements[at].with_changes(leading_lines=two_blank + comments)
        statements.insert(at, function.with_changes(leading_lines=two_blank))
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
        function, init_lines, _ = self.pieces(tree)
        del body[mine]
        for i, stmt in enumerate(body):
            if m.matches(stmt, INIT):
                kept = _without_tail(list(stmt.body.body), init_lines)
                body[i] = stmt.with_changes(body=stmt.body.with_changes(body=kept))
        tree = self.with_body(tree, at, cls, body)
        statements = [
            s
            for s in tree.body
            if not (m.matches(s, DTYPES_DEF) and _same(s, function))
        ]
        self.record(f"`{CLASS}.{METHOD}` and `{FUNCTION}` are removed")
        return tree.with_changes(body=statements)


def _without_tail(stmts: list, tail) -> list:
    n = len(tail)
    if (
        n
        and len(stmts) >= n
        and all(_same(a, b) for a, b in zip(stmts[-n:], tail, strict=True))
    ):
        return stmts[:-n]
    return stmts
