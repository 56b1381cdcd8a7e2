"""Give ``CpuPlatform`` a default IR op priority, as the CUDA and XPU platforms
have: "vllm_c" first for the norms enabled on CPU, native when Inductor compiles."""

import ast
import textwrap

import libcst as cst

from patcher.codemod import TreeCodemod, names, source
from patches.cpu_fused_norms.enable_vllm_c import meaning, norm_impls
from patches.cpu_fused_norms.identity import OPS
from patches.cpu_fused_norms.layout import broken, fits

CLASS = "CpuPlatform"
METHOD = "get_default_ir_op_priority"
CONFIG = "IrOpPriorityConfig"
TYPE_IMPORT = f"from vllm.config.kernel import {CONFIG}"
CI_ENV = "VLLM_CPU_CI_ENV"
VLLM_C_FILE = "vllm/kernels/vllm_c.py"
CONFIG_FILE = "vllm/config/kernel.py"

# At column 0, as ruff lays it out 4 columns in (CpuPlatform's members); the
# holes are laid out for where they stand.
METHOD_TEMPLATE = """\
@classmethod
def get_default_ir_op_priority(
    cls, vllm_config: "VllmConfig"
) -> "IrOpPriorityConfig":
    from vllm.config.compilation import CompilationMode
    from vllm.config.kernel import IrOpPriorityConfig

    # Native used by default when compiling: Inductor fuses the native ops
    # into their neighbours, which an opaque kernel call would prevent.
    # Use the fused vLLM C kernels where available when there is no codegen.
    # Decided on the compilation settings check_and_update_config leaves,
    # which runs after this.
    cc = vllm_config.compilation_config
    backend, mode = cc.backend, cc.mode
    if mode == CompilationMode.VLLM_COMPILE:
        {backend}
    if vllm_config.lora_config is not None:
        mode = CompilationMode.NONE
    using_inductor = backend == "inductor" and mode != CompilationMode.NONE
    default = ["native"] if using_inductor else ["vllm_c", "native"]

    {returned}
"""


BACKEND_AT = 8  # the {backend} hole's column in the template; 12 in the class
RETURNED_AT = 4


def _backend(ci_env: str) -> str:
    """The CI-dependent line, one line or its value in parentheses: each of the
    spellings vLLM 0.20 - 0.33 test CI with fits one of the two."""
    value = f'"eager" if {ci_env} else "inductor"'
    if fits(f"backend = {value}", 4 + BACKEND_AT):
        return f"backend = {value}"
    return broken("backend = (", [value], ")", " " * BACKEND_AT)


def _returned(ops: list[str]) -> str:
    """The return line, one line or its arguments on one line of their own."""
    args = ", ".join(['["native"]', *(f"{op}=default" for op in ops)])
    call = "IrOpPriorityConfig.with_default("
    if fits(f"return {call}{args})", 4 + RETURNED_AT):
        return f"return {call}{args})"
    return broken(f"return {call}", [args], ")", " " * RETURNED_AT)


def _method(cls: cst.ClassDef, name: str) -> cst.FunctionDef | None:
    found = (s for s in cls.body.body if isinstance(s, cst.FunctionDef))
    return next((s for s in found if s.name.value == name), None)


class AddCpuIrOpPriority(TreeCodemod):
    DESCRIPTION = (
        f"Add {CLASS}.{METHOD}: vllm_c first, native when Inductor compiles."
    )
    ON = True  # the change; RemoveCpuIrOpPriority's False: its inverse

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        at, cls = self.top_level_class(tree, CLASS)
        found = _method(cls, METHOD)
        if found is not None or self.ON:
            method, ops = self.method_source(tree, cls)
        if found and meaning(tree.code_for_node(found)) != meaning(method):
            raise self.vllm_has_its_own(f"vLLM's own {CLASS}.{METHOD}")
        if (found is not None) == self.ON:
            return tree
        if self.ON:
            self.record(
                f"`{CLASS}.{METHOD}` is added: {' and '.join(ops)} get "
                '`["vllm_c", "native"]`, `["native"]` when Inductor will compile'
            )
            # its newlines and indents: the tree's
            method = cst.parse_statement(method)
            blank = cst.EmptyLine(indent=False)
            members = [*cls.body.body, method.with_changes(leading_lines=[blank])]
        else:
            self.record(f"`{CLASS}.{METHOD}` is removed")
            members = [s for s in cls.body.body if s is not found]
        tree = self.with_body(tree, at, cls, members)
        # The type import: added unless there, removed unless another use needs it.
        ifs = (i for i, s in enumerate(tree.body) if isinstance(s, cst.If))
        at = next(
            (i for i in ifs if source(tree.body[i].test) == "TYPE_CHECKING"), None
        )
        if at is None:
            return tree
        if names(tree.body[at])[CONFIG] if self.ON else tree.code.count(CONFIG) > 1:
            return tree
        body = [s for s in tree.body[at].body.body if source(s) != TYPE_IMPORT]
        if self.ON:
            later = (  # the type import goes in sorted place
                i
                for i, s in enumerate(body)
                if source(s).startswith("from ") and source(s) > TYPE_IMPORT
            )
            body.insert(next(later, len(body)), cst.parse_statement(TYPE_IMPORT))
            self.record(f"`{CONFIG}` is imported under `if TYPE_CHECKING:`")
        return self.with_body(tree, at, tree.body[at], body)

    def method_source(self, tree: cst.Module, cls: cst.ClassDef):
        """The method this tool writes for the tree (at column 0), and its ops."""
        ops_there = list(norm_impls(self.parse_tree_file(VLLM_C_FILE)))
        classes = self.read_tree_ast(CONFIG_FILE).body
        body = next(
            (c.body for c in classes if getattr(c, "name", "") == CONFIG), None
        )
        fields = [
            getattr(s.target, "id", "")
            for s in body or ()
            if "annotation" in s._fields
        ]
        if not any(getattr(s, "name", None) == "with_default" for s in body or ()):
            raise self.shape_error(
                f"{CONFIG}.with_default in {CONFIG_FILE}",
                f"no class {CONFIG}"
                if body is None
                else f"{CONFIG} fields {fields}",
            )
        ops = [op for op in OPS if op in ops_there and op in fields]
        if not ops:
            raise self.shape_error(
                f"norms with a vllm_c impl in {VLLM_C_FILE}, fields of {CONFIG}",
                f"impls: {ops_there}; fields: {fields}",
            )
        # How check_and_update_config asks for CPU CI: envs.VLLM_CPU_CI_ENV (0.28
        # on) or os.environ.get("VLLM_CPU_CI_ENV", "0") != "0".
        update = _method(cls, "check_and_update_config")
        code = textwrap.dedent(tree.code_for_node(update)) if update else ""
        for node in ast.walk(ast.parse(code)):
            test = getattr(node, "test", None)
            if not test:
                continue
            ci_env = ast.get_source_segment(code, test)
            if CI_ENV in ci_env:
                method = METHOD_TEMPLATE.format(
                    backend=_backend(ci_env), returned=_returned(ops)
                )
                return method, ops
        raise self.shape_error(
            f"{CLASS}.check_and_update_config testing {CI_ENV}",
            "no such test" if update else "no check_and_update_config",
        )


class RemoveCpuIrOpPriority(AddCpuIrOpPriority):
    DESCRIPTION = f"Undo AddCpuIrOpPriority (never vLLM's own {METHOD})."
    ON = False
