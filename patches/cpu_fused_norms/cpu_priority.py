"""Give ``CpuPlatform`` a default IR op priority, as the CUDA and XPU platforms have.

The fused kernels win per call, but under Inductor the native form can win in
the model, because Inductor fuses it into the neighbouring residual add and an
opaque kernel call breaks that fusion. So, like CUDA and XPU: ``native`` when
compiling with Inductor, ``["vllm_c", "native"]`` otherwise. Only for the
norms whose "vllm_c" implementation the tree enables on CPU (never an op some
other gate already enabled there: its CPU default stays as it was); every other
op stays ``native``, since naming a provider an op lacks fails an assertion at
start-up. The norms come from the tree's ``vllm_c.py`` (as the companion edit
leaves it) and must be fields of its ``IrOpPriorityConfig``. The method is laid
out as vLLM's ruff lays it out.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext

from patcher.codemod import TREE_READER, TreeCodemod
from patcher.ruff_format import format_member
from patches.cpu_fused_norms.enable_vllm_c import EnableVllmCOnCpu
from patches.cpu_fused_norms.vllm_c_source import cpu_enabled_norms

CLASS = "CpuPlatform"
METHOD = "get_default_ir_op_priority"
CONFIG = "IrOpPriorityConfig"
CONFIG_MODULE = "vllm.config.kernel"
CONFIG_FILE = "vllm/config/kernel.py"
COMPILATION_FILE = "vllm/config/compilation.py"
TYPE_IMPORT = f"from {CONFIG_MODULE} import {CONFIG}"

METHOD_TEMPLATE = """\
@classmethod
def {method}(
    cls, vllm_config: "VllmConfig"
) -> "{config}":
    from vllm.config.compilation import CompilationMode
    from {config_module} import {config}

    # Native used by default when compiling: Inductor fuses the native ops
    # into their neighbours, which an opaque kernel call would prevent.
    # Use the fused vLLM C kernels where available when there is no codegen.
    cc = vllm_config.compilation_config
    using_inductor = cc.backend == "inductor" and cc.mode != CompilationMode.NONE
    default = ["native"] if using_inductor else ["vllm_c", "native"]

    return {config}.with_default(["native"], {per_op})
"""

TYPE_CHECKING_IF = m.If(test=m.Name("TYPE_CHECKING"))
CPU_CLASS = m.ClassDef(name=m.Name(CLASS))
PRIORITY_METHOD = m.FunctionDef(name=m.Name(METHOD))


def _config_fields(module: cst.Module) -> tuple[list[str], bool]:
    """``IrOpPriorityConfig``'s annotated fields and whether it has ``with_default``."""
    for cls in m.findall(module, m.ClassDef(name=m.Name(CONFIG))):
        body = cls.body.body
        fields = [
            s.body[0].target.value
            for s in body
            if m.matches(s, m.SimpleStatementLine([m.AnnAssign(target=m.Name())]))
        ]
        with_default = any(
            m.matches(s, m.FunctionDef(m.Name("with_default"))) for s in body
        )
        return fields, with_default
    return [], False


class _CpuPlatformCodemod(TreeCodemod):
    def has_method(self, tree: cst.Module) -> bool:
        """Whether ``CpuPlatform`` defines the method (refusing a tree without it)."""
        classes = m.findall(tree, CPU_CLASS)
        if not classes:
            names = [c.name.value for c in m.findall(tree, m.ClassDef())]
            raise self.shape_error(f"class {CLASS}", f"classes: {names or 'none'}")
        return bool(m.findall(classes[0], PRIORITY_METHOD))


class AddCpuIrOpPriority(_CpuPlatformCodemod):
    DESCRIPTION = (
        f"Add {CLASS}.{METHOD}: vllm_c first for the norms enabled on CPU, "
        "native when compiling with Inductor."
    )

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        if self.has_method(tree):
            return tree  # already there, ours or upstream's
        self.method = self._method(tree)
        return tree.visit(self)

    def _method(self, tree: cst.Module) -> cst.FunctionDef:
        vllm_c = EnableVllmCOnCpu.TARGET
        # The norms as the companion edit leaves vllm_c.py (it may not have run
        # yet); what it would record is its own business.
        context = CodemodContext(scratch={TREE_READER: self.read_tree_file})
        patched = EnableVllmCOnCpu(context).transform_module(
            self.parse_tree_file(vllm_c)
        )
        fields, with_default = _config_fields(self.parse_tree_file(CONFIG_FILE))
        if not with_default:
            raise self.shape_error(
                f"{CONFIG}.with_default in {CONFIG_FILE}",
                f"{CONFIG} fields {fields}" if fields else f"no class {CONFIG}",
            )
        # Exactly the norms: an op some other gate already enables on CPU
        # keeps its native default.
        ops = [op for op in cpu_enabled_norms(patched) if op in fields]
        if not ops:
            raise self.shape_error(
                f"norms enabled on CPU in {vllm_c} that are fields of {CONFIG}",
                f"enabled: {cpu_enabled_norms(patched)}; fields: {fields}",
            )
        if "class CompilationMode" not in self.read_tree_file(COMPILATION_FILE):
            raise self.shape_error(
                f"class CompilationMode in {COMPILATION_FILE}", "no such class"
            )
        source = METHOD_TEMPLATE.format(
            method=METHOD,
            config=CONFIG,
            config_module=CONFIG_MODULE,
            per_op=", ".join(f"{op}=default" for op in ops),
        )
        listed = " and ".join(f"`{op}`" for op in ops)
        self.record(
            f"`{CLASS}.{METHOD}` is added: {listed} get "
            '`["vllm_c", "native"]` when not compiling with Inductor and '
            '`["native"]` when compiling; every other op keeps `["native"]`'
        )
        method = format_member(source, tree)
        return method.with_changes(leading_lines=[cst.EmptyLine(indent=False)])

    def leave_ClassDef(self, original_node, updated_node):
        if not m.matches(original_node, CPU_CLASS):
            return updated_node
        body = updated_node.body
        return updated_node.with_changes(
            body=body.with_changes(body=[*body.body, self.method])
        )

    def leave_If(self, original_node, updated_node):
        """Add the config's type import to ``if TYPE_CHECKING:``, in sorted place."""
        if original_node not in self.module.body or not m.matches(
            original_node, TYPE_CHECKING_IF
        ):
            return updated_node
        body = list(updated_node.body.body)
        if any(m.findall(s, m.ImportAlias(name=m.Name(CONFIG))) for s in body):
            return updated_node
        new = cst.parse_statement(TYPE_IMPORT, config=self.module.config_for_parsing)
        at = len(body)
        for i, stmt in enumerate(body):
            if m.matches(
                stmt, m.SimpleStatementLine([m.ImportFrom(module=m.DoNotCare())])
            ):
                module = cst.Module([]).code_for_node(stmt.body[0].module)
                if module > CONFIG_MODULE:
                    at = i
                    break
        body.insert(at, new)
        self.record(f"`{CONFIG}` is imported under `if TYPE_CHECKING:`")
        return updated_node.with_changes(body=updated_node.body.with_changes(body=body))


class RemoveCpuIrOpPriority(_CpuPlatformCodemod):
    DESCRIPTION = f"Undo AddCpuIrOpPriority: drop {CLASS}.{METHOD} and its type import."

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        return tree.visit(self) if self.has_method(tree) else tree

    @m.call_if_inside(CPU_CLASS)
    def leave_FunctionDef(self, original_node, updated_node):
        if m.matches(original_node, PRIORITY_METHOD):
            self.record(f"`{CLASS}.{METHOD}` is removed")
            return cst.RemoveFromParent()
        return updated_node

    def leave_Module(self, original_node, updated_node):
        # The type import goes too, once nothing else in the file names the config.
        code = updated_node.code
        if code.count(CONFIG) > 1:
            return updated_node
        return updated_node.visit(_DropTypeImport())


class _DropTypeImport(cst.CSTTransformer):
    def leave_SimpleStatementLine(self, original_node, updated_node):
        if m.matches(
            original_node,
            m.SimpleStatementLine(
                [m.ImportFrom(names=[m.ImportAlias(name=m.Name(CONFIG))])]
            ),
        ):
            return cst.RemoveFromParent()
        return updated_node
