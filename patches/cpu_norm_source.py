"""The rule's code (``cpu_norm_rule.py``) as LibCST nodes for the codemods to
write into a vLLM tree, adapted to it; torch-free, the rule module only parsed."""

import symtable
import sys
from functools import cache
from pathlib import Path

import libcst as cst
import libcst.matchers as m

from patcher.codemod import names, source

RULE_FILE = Path(__file__).with_name("cpu_norm_rule.py")
FUNCTIONS = ("cpu_norm_dtypes", "cpu_threads_shared")
MIXIN = "RMSNormForwardCpu"
IMPORTS = ("functools", "os")  # what the functions need, in the stdlib group
CPU_PY = "vllm/platforms/cpu.py"
# cpu.py loads a build per x86 CPU class (from 0.19): only then does x86's
# bfloat16 depend on the CPU (``_C`` with AVX512-BF16 rounds, the others truncate).
PER_ISA_BUILDS = "_C_AVX512"
X86_TEST = "arch == CpuArchEnum.X86"
# Batch invariance as the rule spells it, and as a tree may, by the name its
# layernorm.py imports: the environment variable from 0.19, a function before.
BATCH_INVARIANT = "envs.VLLM_BATCH_INVARIANT"
SPELLINGS = {
    "envs": BATCH_INVARIANT,
    "vllm_is_batch_invariant": "vllm_is_batch_invariant()",
}


@cache
def _rule() -> cst.Module:
    return cst.parse_module(RULE_FILE.read_text("utf-8"))


def _top_level(name: str) -> cst.FunctionDef | cst.ClassDef:
    return next(
        s for s in _rule().body if getattr(s, "name", None) and s.name.value == name
    )


def _member(name: str) -> cst.FunctionDef:
    members = _top_level(MIXIN).body.body
    defs = (s for s in members if isinstance(s, cst.FunctionDef))
    return next(s for s in defs if s.name.value == name)


def functions(cpu_py: str) -> list[cst.FunctionDef]:
    """The module-level functions, x86's bfloat16 check only where ``cpu_py``
    loads a build per x86 CPU class (else x86 keeps bfloat16 native)."""
    found = [_top_level(name).with_changes(leading_lines=()) for name in FUNCTIONS]
    if PER_ISA_BUILDS in cpu_py:
        return found
    dtypes = found[0]
    body = [s for s in dtypes.body.body if not _is_x86_check(s)]
    found[0] = dtypes.with_changes(body=dtypes.body.with_changes(body=body))
    return found


def _is_x86_check(statement: cst.BaseStatement) -> bool:
    return isinstance(statement, cst.If) and source(statement.test) == X86_TEST


def forward_cpu() -> cst.FunctionDef:
    return _member("forward_cpu").with_changes(leading_lines=())


def init_lines(spelling: str) -> list[cst.BaseStatement]:
    """``bind_cpu_ops``'s body but its docstring, batch invariance spelled so."""
    body = list(_member("bind_cpu_ops").body.body[1:])
    if spelling == BATCH_INVARIANT:
        return body
    old = cst.parse_expression(BATCH_INVARIANT)
    new = cst.parse_expression(spelling)
    return [s.deep_replace(n, new) if (n := _find(s, old)) else s for s in body]


def _find(node: cst.CSTNode, expr: cst.BaseExpression) -> cst.CSTNode | None:
    found = m.findall(node, m.Attribute())
    return next((f for f in found if f.deep_equals(expr)), None)


def spelling(tree: cst.Module) -> str | None:
    """How ``tree`` (a layernorm.py) spells batch invariance, by what it imports."""
    used = names(tree)
    return next((s for name, s in SPELLINGS.items() if used[name]), None)


def binds(code: str, cls: str, name: str) -> bool:
    """Whether class ``cls``'s body binds ``name`` in any form (def, assignment,
    annotation, import, decorated def): Python's own symbol table says."""
    tables = symtable.symtable(code, "<tree>", "exec").get_children()
    table = next(
        (t for t in tables if t.get_name() == cls and t.get_type() == "class"), None
    )
    return (
        table is not None
        and name in table.get_identifiers()
        and table.lookup(name).is_local()
    )


def call_checks(
    x: str, weight: str, dtypes: str, residual: str | None = None
) -> str:
    """The IR form's per-call condition as source, given its names.

    vLLM IR passes ``weight=None`` for a weightless norm (the impls declare
    ``weight_may_be_none=True``), which the CPU kernels of releases before 0.32
    refuse. The kernels take the hidden size in blocks of 8.
    """
    checks = [
        f"{weight} is not None",
        f"{x}.dtype in {dtypes}",
        f"{weight}.dtype == {x}.dtype",
        f"{x}.shape[-1] % 8 == 0",
        f"{x}.is_contiguous()",
    ]
    if residual is not None:
        checks += [f"{residual}.dtype == {x}.dtype", f"{residual}.is_contiguous()"]
    return " and ".join(checks)


def _first_import(body) -> int:
    imports = m.SimpleStatementLine(body=[m.Import() | m.ImportFrom()])
    return next(i for i, s in enumerate(body) if m.matches(s, imports))


def _stdlib(statement: cst.BaseStatement) -> tuple[str, str] | None:
    """("import" or "from", the module) for a one-line stdlib import, else None."""
    code = source(statement)
    kind, _, rest = code.partition(" ")
    module = rest.split(" ")[0]
    if kind in ("import", "from") and "," not in code:
        if module.split(".")[0] in sys.stdlib_module_names:
            return kind, module
    return None


def with_imports(tree: cst.Module, on: bool) -> cst.Module:
    """``tree`` with ``IMPORTS`` in its stdlib group in isort's order (a new
    group before its first import if it has none) (``on``); or without those
    nothing else uses."""
    body = list(tree.body)
    plain = {f"import {n}": n for n in IMPORTS}
    if not on:
        mine = [i for i, s in enumerate(body) if source(s) in plain]
        used = names(tree)
        drop = [i for i in mine if used[plain[source(body[i])]] == 1]
        if drop and drop[0] == _first_import(body):  # the next kept takes its lines
            lines = body[drop[0]].leading_lines
            after = next(i for i in range(drop[0], len(body)) if i not in drop)
            body[after] = body[after].with_changes(leading_lines=lines)
        return tree.with_changes(
            body=[s for i, s in enumerate(body) if i not in drop]
        )
    for n in IMPORTS:
        if f"import {n}" in map(source, body):
            continue
        group = {i: found for i, s in enumerate(body) if (found := _stdlib(s))}
        first = _first_import(body)
        if not group:  # a group of its own, first
            at = first
            blank = [cst.EmptyLine(indent=False)]
        else:  # plain imports sorted, before the group's ``from`` imports
            later = [i for i, (kind, m) in group.items() if kind == "from" or m > n]
            at = min(later) if later else max(group) + 1
            blank = []
        new = cst.parse_statement(f"import {n}\n", tree.config_for_parsing)
        if at == first:  # first of the file's imports: the lines above it
            new = new.with_changes(leading_lines=body[at].leading_lines)
            body[at] = body[at].with_changes(leading_lines=blank)
        body.insert(at, new)
    return tree.with_changes(body=body)
