"""Give ``CpuPlatform`` a default IR op priority, as the CUDA and XPU platforms have.

``["vllm_c", "native"]`` for the norms with a "vllm_c" impl in the tree's
``vllm_c.py`` that are fields of its ``IrOpPriorityConfig``, and ``native``
when Inductor will compile the model: Inductor fuses the native norm into the
neighbouring residual add, which an opaque kernel call would prevent. vLLM asks
before ``CpuPlatform.check_and_update_config`` rewrites the compilation settings
(``VLLM_COMPILE`` becomes Inductor, or eager under ``VLLM_CPU_CI_ENV``; LoRA
turns compilation off), so the method decides on what that rewrite will leave,
with the tree's own spelling of the CI check. Every other op keeps ``native``:
naming a provider an op lacks fails an assertion at start-up. A
``get_default_ir_op_priority`` that is not this one is vLLM's own, left alone.
"""

from __future__ import annotations

import ast
import textwrap

import libcst as cst

from patcher.codemod import TreeCodemod, names, source
from patcher.ruff_format import format_member
from patches.cpu_fused_norms.identity import OPS, UPSTREAM_PROVIDER

CLASS = "CpuPlatform"
METHOD = "get_default_ir_op_priority"
CONFIG = "IrOpPriorityConfig"
CONFIG_MODULE = "vllm.config.kernel"
CONFIG_FILE = "vllm/config/kernel.py"
VLLM_C_FILE = "vllm/kernels/vllm_c.py"
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


def _method(cls: cst.ClassDef, name: str) -> cst.FunctionDef | None:
    return next(
        (
            s
            for s in cls.body.body
            if isinstance(s, cst.FunctionDef) and s.name.value == name
        ),
        None,
    )


def _type_checking(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.If) and source(stmt.test) == "TYPE_CHECKING"


def _import_from(stmt: cst.CSTNode) -> cst.ImportFrom | None:
    if isinstance(stmt, cst.SimpleStatementLine) and isinstance(
        stmt.body[0], cst.ImportFrom
    ):
        return stmt.body[0]
    return None


class _Tests(cst.CSTVisitor):
    """The tests of every ``if`` and conditional expression in a node."""

    def __init__(self) -> None:
        self.found: list[cst.BaseExpression] = []

    def visit_If(self, node: cst.If) -> None:
        self.found.append(node.test)

    def visit_IfExp(self, node: cst.IfExp) -> None:
        self.found.append(node.test)


def _config_fields(module: ast.Module) -> tuple[list[str], bool]:
    """``IrOpPriorityConfig``'s annotated fields and whether it has ``with_default``."""
    for cls in module.body:
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


def _vllm_c_ops(module: ast.Module) -> list[str]:
    """The ops ``vllm_c.py`` registers a "vllm_c" impl of:
    ``@ir.ops.<op>.register_impl("vllm_c", ...)``."""
    return [
        d.func.value.attr
        for f in module.body
        if isinstance(f, ast.FunctionDef)
        for d in f.decorator_list
        if isinstance(d, ast.Call)
        and isinstance(d.func, ast.Attribute)
        and d.func.attr == "register_impl"
        and isinstance(d.func.value, ast.Attribute)
        and d.args
        and isinstance(d.args[0], ast.Constant)
        and d.args[0].value == UPSTREAM_PROVIDER
    ]


CI_ENV = "VLLM_CPU_CI_ENV"


class _Priority(TreeCodemod):
    def existing(self, tree: cst.Module):
        """(the class's index, the class, its priority method or None); a method
        other than this tool's is vLLM's own, and raises ``VllmHasItsOwn``."""
        at, cls = self.top_level_class(tree, CLASS)
        found = _method(cls, METHOD)
        if found is not None and _meaning(
            textwrap.dedent(tree.code_for_node(found).lstrip("\r\n"))
        ) != _meaning(self.method_source(tree, cls)[0]):
            raise self.vllm_has_its_own(f"vLLM's own {CLASS}.{METHOD}")
        return at, cls, found

    def ci_env(self, tree: cst.Module, cls: cst.ClassDef) -> str:
        """How ``check_and_update_config`` asks for CPU CI: ``envs.VLLM_CPU_CI_ENV``
        (0.28 on) or ``os.environ.get("VLLM_CPU_CI_ENV", "0") != "0"``."""
        update, tests = _method(cls, "check_and_update_config"), _Tests()
        if update is not None:
            update.visit(tests)
        for test in tests.found:
            code = tree.code_for_node(test)
            if CI_ENV in code:
                return code
        raise self.shape_error(
            f"{CLASS}.check_and_update_config testing {CI_ENV}",
            "no such test" if update else "no check_and_update_config",
        )

    def method_source(self, tree: cst.Module, cls: cst.ClassDef):
        """The method this tool writes for the tree (at column 0), and its ops."""
        ops_there = _vllm_c_ops(self.read_tree_ast(VLLM_C_FILE))
        fields, with_default = _config_fields(self.read_tree_ast(CONFIG_FILE))
        if not with_default:
            raise self.shape_error(
                f"{CONFIG}.with_default in {CONFIG_FILE}",
                f"{CONFIG} fields {fields}" if fields else f"no class {CONFIG}",
            )
        ops = [op for op in OPS if op in ops_there and op in fields]
        if not ops:
            raise self.shape_error(
                f"norms with a vllm_c impl in {VLLM_C_FILE}, fields of {CONFIG}",
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
            ci_env=self.ci_env(tree, cls),
            per_op=", ".join(f"{op}=default" for op in ops),
        )
        return source, ops


def _meaning(source: str) -> str:
    return ast.dump(ast.parse(source))


class AddCpuIrOpPriority(_Priority):
    DESCRIPTION = (
        f"Add {CLASS}.{METHOD}: vllm_c first for the norms enabled on CPU, "
        "native when the model will be compiled with Inductor."
    )

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        at, cls, found = self.existing(tree)
        if found is not None:
            return tree
        source, ops = self.method_source(tree, cls)
        listed = " and ".join(f"`{op}`" for op in ops)
        self.record(
            f"`{CLASS}.{METHOD}` is added: {listed} get "
            '`["vllm_c", "native"]` unless the model will be compiled with '
            "Inductor (decided on the compilation settings "
            '`check_and_update_config` leaves), then `["native"]`; every '
            'other op keeps `["native"]`'
        )
        method = format_member(source, tree)
        method = method.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
        tree = self.with_body(tree, at, cls, [*cls.body.body, method])
        for i, stmt in enumerate(tree.body):
            if _type_checking(stmt):
                return self.with_body(tree, i, stmt, self._type_import(stmt))
        return tree

    def _type_import(self, node: cst.If) -> list[cst.BaseStatement]:
        """The config's type import added to ``if TYPE_CHECKING:``, in sorted place."""
        body = list(node.body.body)
        if any(names(s)[CONFIG] for s in body):
            return body
        new = cst.parse_statement(TYPE_IMPORT)
        at = len(body)
        for i, stmt in enumerate(body):
            found = _import_from(stmt)
            if found is not None and found.module is not None:
                if source(found.module) > CONFIG_MODULE:
                    at = i
                    break
        body.insert(at, new)
        self.record(f"`{CONFIG}` is imported under `if TYPE_CHECKING:`")
        return body


class RemoveCpuIrOpPriority(_Priority):
    DESCRIPTION = (
        f"Undo AddCpuIrOpPriority: drop this tool's {CLASS}.{METHOD} (never "
        "vLLM's own) and its type import."
    )

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        at, cls, found = self.existing(tree)
        if found is None:
            return tree
        self.record(f"`{CLASS}.{METHOD}` is removed")
        tree = self.with_body(
            tree, at, cls, [s for s in cls.body.body if s is not found]
        )
        if tree.code.count(CONFIG) > 1:  # something else names the config
            return tree
        for i, stmt in enumerate(tree.body):
            if _type_checking(stmt):
                kept = [s for s in stmt.body.body if source(s) != TYPE_IMPORT]
                return self.with_body(tree, i, stmt, kept)
        return tree
