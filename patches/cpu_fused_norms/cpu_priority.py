"""Give ``CpuPlatform`` a default IR op priority, as the CUDA and XPU platforms have.

The fused kernels win per call, but under Inductor the native form can win in
the model, because Inductor fuses it into the neighbouring residual add and an
opaque kernel call breaks that fusion. So, like CUDA and XPU: ``native`` when
compiling with Inductor, ``["vllm_c", "native"]`` otherwise. vLLM asks before
``CpuPlatform.check_and_update_config`` rewrites the compilation settings
(``VLLM_COMPILE`` becomes Inductor, or eager under ``VLLM_CPU_CI_ENV``; LoRA
turns compilation off), so the method decides on what that rewrite will leave,
with the tree's own spelling of the CI check. Only for the
norms whose "vllm_c" implementation the tree enables on CPU (never an op some
other gate already enabled there: its CPU default stays as it was); every other
op stays ``native``, since naming a provider an op lacks fails an assertion at
start-up. The norms come from the tree's ``vllm_c.py`` (as the companion edit
leaves it) and must be fields of its ``IrOpPriorityConfig``. The method is laid
out as vLLM's ruff lays it out.
"""

from __future__ import annotations

import ast

import libcst as cst
import libcst.matchers as m

from patcher.codemod import TreeCodemod
from patcher.ruff_format import format_member
from patches.cpu_fused_norms.enable_vllm_c import EnableVllmCOnCpu
from patches.cpu_fused_norms.vllm_c_source import NORM_OPS, vllm_c_impls

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
    # Decided on the compilation settings check_and_update_config leaves,
    # which runs after this.
    cc = vllm_config.compilation_config
    backend, mode = cc.backend, cc.mode
    if mode == CompilationMode.VLLM_COMPILE:
        backend = "eager" if {ci_env} else "inductor"
    if vllm_config.lora_config is not None:
        mode = CompilationMode.NONE
    using_inductor = backend == "inductor" and mode != CompilationMode.NONE
    default = ["native"] if using_inductor else ["vllm_c", "native"]

    return {config}.with_default(["native"], {per_op})
"""

TYPE_CHECKING_IF = m.If(test=m.Name("TYPE_CHECKING"))
PRIORITY_METHOD = m.FunctionDef(name=m.Name(METHOD))


TYPE_IMPORT_LINE = m.SimpleStatementLine(
    [m.ImportFrom(names=[m.ImportAlias(name=m.Name(CONFIG))])]
)


def _config_fields(source: str) -> tuple[list[str], bool]:
    """``IrOpPriorityConfig``'s annotated fields and whether it has ``with_default``
    (read with ``ast``: the file is only read, and ``ast`` is fast)."""
    for cls in ast.parse(source).body:
        if isinstance(cls, ast.ClassDef) and cls.name == CONFIG:
            fields = [
                s.target.id
                for s in cls.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            ]
            with_default = any(
                isinstance(s, ast.FunctionDef) and s.name == "with_default"
                for s in cls.body
            )
            return fields, with_default
    return [], False


CI_ENV = "VLLM_CPU_CI_ENV"
UPDATE_METHOD = m.FunctionDef(name=m.Name("check_and_update_config"))


class AddCpuIrOpPriority(TreeCodemod):
    DESCRIPTION = (
        f"Add {CLASS}.{METHOD}: vllm_c first for the norms enabled on CPU, "
        "native when the model will be compiled with Inductor."
    )

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        at, cls = self.top_level_class(tree, CLASS)
        members = list(cls.body.body)
        if any(m.matches(s, PRIORITY_METHOD) for s in members):
            return tree  # already there, ours or upstream's
        tree = self.with_body(tree, at, cls, [*members, self._method(tree, cls)])
        for i, stmt in enumerate(tree.body):
            if m.matches(stmt, TYPE_CHECKING_IF):
                return self.with_body(tree, i, stmt, self._type_import(stmt))
        return tree

    def _ci_env(self, tree: cst.Module, cls: cst.ClassDef) -> str:
        """How ``check_and_update_config`` asks for CPU CI: ``envs.VLLM_CPU_CI_ENV``
        (0.28 on) or ``os.environ.get("VLLM_CPU_CI_ENV", "0") != "0"``."""
        update = next((s for s in cls.body.body if m.matches(s, UPDATE_METHOD)), None)
        for node in m.findall(update, m.IfExp() | m.If()) if update else ():
            code = tree.code_for_node(node.test)
            if CI_ENV in code:
                return code
        raise self.shape_error(
            f"{CLASS}.check_and_update_config testing {CI_ENV}",
            "no such test" if update else "no check_and_update_config",
        )

    def _method(self, tree: cst.Module, cls: cst.ClassDef) -> cst.FunctionDef:
        vllm_c = EnableVllmCOnCpu.TARGET
        # The norms as the companion edit leaves vllm_c.py (it may not have run
        # yet): it enables every norm that has a vllm_c impl, or refuses.
        ops_there = [i.op for i in vllm_c_impls(self.parse_tree_file(vllm_c))]
        fields, with_default = _config_fields(self.read_tree_file(CONFIG_FILE))
        if not with_default:
            raise self.shape_error(
                f"{CONFIG}.with_default in {CONFIG_FILE}",
                f"{CONFIG} fields {fields}" if fields else f"no class {CONFIG}",
            )
        ops = [op for op in NORM_OPS if op in ops_there and op in fields]
        if not ops:
            raise self.shape_error(
                f"norms with a vllm_c impl in {vllm_c} that are fields of {CONFIG}",
                f"impls: {ops_there}; fields: {fields}",
            )
        if "class CompilationMode" not in self.read_tree_file(COMPILATION_FILE):
            raise self.shape_error(
                f"class CompilationMode in {COMPILATION_FILE}", "no such class"
            )
        source = METHOD_TEMPLATE.format(
            method=METHOD,
            config=CONFIG,
            config_module=CONFIG_MODULE,
            ci_env=self._ci_env(tree, cls),
            per_op=", ".join(f"{op}=default" for op in ops),
        )
        listed = " and ".join(f"`{op}`" for op in ops)
        self.record(
            f"`{CLASS}.{METHOD}` is added: {listed} get "
            '`["vllm_c", "native"]` unless the model will be compiled with '
            "Inductor (decided on the compilation settings "
            '`check_and_update_config` leaves), then `["native"]`; every '
            'other op keeps `["native"]`'
        )
        method = format_member(source, tree)
        return method.with_changes(leading_lines=[cst.EmptyLine(indent=False)])

    def _type_import(self, node: cst.If) -> list[cst.BaseStatement]:
        """The config's type import added to ``if TYPE_CHECKING:``, in sorted place."""
        body = list(node.body.body)
        if any(m.findall(s, m.ImportAlias(name=m.Name(CONFIG))) for s in body):
            return body
        new = cst.parse_statement(TYPE_IMPORT)
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
        return body


class RemoveCpuIrOpPriority(TreeCodemod):
    DESCRIPTION = f"Undo AddCpuIrOpPriority: drop {CLASS}.{METHOD} and its type import."

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        at, cls = self.top_level_class(tree, CLASS)
        members = [s for s in cls.body.body if not m.matches(s, PRIORITY_METHOD)]
        if len(members) == len(cls.body.body):
            return tree
        self.record(f"`{CLASS}.{METHOD}` is removed")
        tree = self.with_body(tree, at, cls, members)
        if tree.code.count(CONFIG) > 1:  # something else names the config
            return tree
        for i, stmt in enumerate(tree.body):
            if m.matches(stmt, TYPE_CHECKING_IF):
                kept = [s for s in stmt.body.body if not m.matches(s, TYPE_IMPORT_LINE)]
                return self.with_body(tree, i, stmt, kept)
        return tree
