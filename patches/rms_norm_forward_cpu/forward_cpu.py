"""Give ``RMSNorm`` a ``forward_cpu`` in ``GELU.forward_cpu``'s idiom
(``layers/activation.py``): decided in ``__init__``, the ops bound there, vLLM's
CPU kernels where they match native (``patches/cpu_norm_rule.py``)."""

import libcst as cst

from patcher.codemod import TreeCodemod
from patches import cpu_norm_source as rule

CLASS = "RMSNorm"
METHOD = "forward_cpu"
ADDED = (
    f"`{CLASS}.{METHOD}` is added: `torch.ops._C.rms_norm` and "
    "`fused_add_rms_norm`, bound in `__init__` where the layer and the machine "
    "allow them (`cpu_norm_dtypes()`, `cpu_threads_shared()`), for contiguous "
    "inputs of the weight's dtype; `forward_native` elsewhere"
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
        method = rule.forward_cpu()
        mine = _def_at(body, METHOD)
        if mine is not None and not _same(body[mine], method):
            mine = None  # a def of vLLM's own
        if rule.binds(tree.code, CLASS, METHOD):
            without = [s for i, s in enumerate(body) if i != mine]
            if mine is None or rule.binds(
                self.with_body(tree, at, cls, without).code, CLASS, METHOD
            ):
                raise self.vllm_has_its_own(f"vLLM's own {CLASS}.{METHOD}")
        if (mine is not None) == self.ON:
            return tree  # applied already, or reverted already
        init = _def_at(body, "__init__")
        anchor = _def_at(body, "forward_native")
        if self.ON and (anchor is None or init is None):
            raise self.shape_error(
                f"{CLASS}.__init__ and {CLASS}.forward_native", "missing"
            )
        spelling = rule.spelling(tree)
        if spelling is None:
            raise self.shape_error(
                "an import of vllm_is_batch_invariant or vllm.envs",
                "neither is imported",
            )
        lines = rule.init_lines(spelling)
        functions = rule.functions(self.read_tree_file(rule.CPU_PY))
        if init is not None:  # its last lines: the ops bound for the layer
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
            added = [
                f.with_changes(leading_lines=[blank, blank]) for f in functions
            ]
            statements[at:at] = added
            self.record(ADDED)
        else:
            theirs = [
                i for i, s in enumerate(statements) if _is_one_of(s, functions)
            ]
            statements = [s for i, s in enumerate(statements) if i not in theirs]
            self.record(
                f"`{CLASS}.{METHOD}` and `{'`, `'.join(rule.FUNCTIONS)}` go"
            )
        return rule.with_imports(tree.with_changes(body=statements), self.ON)


def _is_one_of(statement: cst.CSTNode, functions: list[cst.FunctionDef]) -> bool:
    return any(_same(statement, f) for f in functions)


class RemoveRmsNormForwardCpu(AddRmsNormForwardCpu):
    DESCRIPTION = f"Undo AddRmsNormForwardCpu (never vLLM's own {METHOD})."
    ON = False
