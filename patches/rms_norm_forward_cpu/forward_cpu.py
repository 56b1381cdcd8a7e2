"""Give ``RMSNorm`` a ``forward_cpu`` in ``GELU.forward_cpu``'s idiom
(``layers/activation.py``): vLLM's CPU kernels where they match native (``rule.py``)."""

import textwrap

import libcst as cst

from patcher.codemod import TreeCodemod, names
from patcher.ruff_format import format_member, format_source
from patches.rms_norm_forward_cpu import rule

CLASS = "RMSNorm"
METHOD = "forward_cpu"
FUNCTION = "cpu_fused_norm_dtypes"
ADDED = (
    f"`{CLASS}.{METHOD}` is added: `ops.rms_norm` and `ops.fused_add_rms_norm` "
    "where they match `forward_native` (contiguous, a hidden size a multiple of 8, "
    f"one of the dtypes `{FUNCTION}()` finds here), `forward_native` elsewhere"
)


def _def_at(body, name: str) -> int | None:
    found = (i for i, s in enumerate(body) if isinstance(s, cst.FunctionDef))
    return next((i for i in found if body[i].name.value == name), None)


def _same(a: cst.CSTNode, b: cst.CSTNode) -> bool:
    """The same code, whatever the blank lines and comments above it."""
    return a.with_changes(leading_lines=()).deep_equals(
        b.with_changes(leading_lines=())
    )


class AddRmsNormForwardCpu(TreeCodemod):
    DESCRIPTION = f"Add {CLASS}.{METHOD}: the CPU kernels where they match native."
    ON = True  # the change; RemoveRmsNormForwardCpu's False: its inverse

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        at, cls = self.top_level_class(tree, CLASS)
        body = list(cls.body.body)
        mine, init = _def_at(body, METHOD), _def_at(body, "__init__")
        function, lines, method = self.pieces(tree)
        if mine is not None and not _same(body[mine], method):
            raise self.vllm_has_its_own(f"vLLM's own {CLASS}.{METHOD}")
        if (mine is not None) == self.ON:
            return tree  # applied already, or reverted already
        anchor = _def_at(body, "forward_native")
        if self.ON and (anchor is None or init is None):
            raise self.shape_error(
                f"{CLASS}.__init__ and {CLASS}.forward_native", "missing"
            )
        if init is not None:  # its last lines: the rule's dtypes for the layer
            fn, old = body[init], body[init].body.body
            n = len(old) - len(lines)
            if self.ON or (n >= 0 and all(map(_same, old[n:], lines))):
                new = [*old, *lines] if self.ON else old[:n]
                body[init] = fn.with_changes(body=fn.body.with_changes(body=new))
        blank = cst.EmptyLine(indent=False)
        if self.ON:
            body.insert(anchor + 1, method.with_changes(leading_lines=[blank]))
        else:
            del body[mine]
        tree = self.with_body(tree, at, cls, body)
        statements = list(tree.body)
        if self.ON:  # above the class and the comments that belong to it
            comments = [c for c in statements[at].leading_lines if c.comment]
            leading = [blank, blank, *comments]
            statements[at] = statements[at].with_changes(leading_lines=leading)
            statements.insert(at, function.with_changes(leading_lines=[blank, blank]))
            self.record(ADDED)
        else:
            i = _def_at(statements, FUNCTION)
            if i is not None and _same(statements[i], function):
                del statements[i]
            self.record(f"`{CLASS}.{METHOD}` and `{FUNCTION}` are removed")
        return tree.with_changes(body=statements)

    def pieces(self, tree: cst.Module) -> tuple:
        """The function, the ``__init__`` lines and the method, laid out for this
        tree, spelling batch invariance by the name ``layernorm.py`` imports."""
        used = names(tree)
        spelling = [s for n, s in rule.BATCH_INVARIANT.items() if used[n]]
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


class RemoveRmsNormForwardCpu(AddRmsNormForwardCpu):
    DESCRIPTION = f"Undo AddRmsNormForwardCpu (never vLLM's own {METHOD})."
    ON = False
