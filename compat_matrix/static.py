"""Checks on a vLLM wheel (or any vLLM tree) without installing or importing it:
which IR ops exist, what ``IrOp.register_impl`` accepts, which ops
``IrOpPriorityConfig`` has fields for, what ``vllm_c`` registers and under
which gate, whether the out-of-tree provider's API use fits, and whether each
carried patch applies (``vllm-patch check``/``diff`` on the tree).

Each check is a dict shaped like the probe's checks:
``{"name", "status": "pass"|"fail"|"skip", "reason", "seconds", "details"}``.
"""

from __future__ import annotations

import ast
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import libcst as cst

from compat_matrix.check_status import CheckStatus
from compat_matrix.probe.framework import PROVIDER_MODULE
from patcher.engine import plan
from patcher.errors import PatchError
from patcher.patchset import all_patches
from patcher.status import PlanStatus
from patcher.tree import VllmTree, open_tree
from patcher.version import read_version
from patches.cpu_fused_norms.vllm_c_source import vllm_c_impls as patched_impls

IR_OP_FILE = "vllm/ir/op.py"
VLLM_C_FILE = "vllm/kernels/vllm_c.py"
# The static checks that read vLLM IR's own files: a tree without IR skips them.
IR_CHECKS = ("wheel_priority_config", "provider_api")
CONFIG_FILES = (
    "vllm/config/kernel.py",
    "vllm/config/compilation.py",
    "vllm/config/__init__.py",
)


def _check(name: str, status: str, reason: str = "", **details: Any) -> dict[str, Any]:
    return {
        "name": name,
        "status": status,
        "reason": reason,
        "seconds": 0.0,
        "details": details,
    }


def _parse(tree: VllmTree, rel: str) -> ast.Module | None:
    if not tree.exists(rel):
        return None
    return ast.parse(tree.read_bytes(rel), filename=tree.display(rel))


def _names(tree: VllmTree, folder: str) -> list[str]:
    """The ``.py`` files directly in ``folder`` of the tree, relative paths."""
    if tree.is_wheel:
        prefix = folder.rstrip("/") + "/"
        return sorted(
            n
            for n in tree._zip_names  # noqa: SLF001 - the tree's own listing
            if n.startswith(prefix)
            and n.endswith(".py")
            and "/" not in n[len(prefix) :]
        )
    return sorted(f"{folder}/{p.name}" for p in tree.path(folder).glob("*.py"))


def _decorator_name(node: ast.expr) -> str:
    target = node.func if isinstance(node, ast.Call) else node
    return (
        target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
    )


# --- facts read from the wheel -------------------------------------------------


def ir_ops(tree: VllmTree) -> list[str]:
    """Functions decorated with ``@register_op`` in ``vllm/ir/ops/``."""
    ops = []
    for rel in _names(tree, "vllm/ir/ops"):
        module = _parse(tree, rel)
        for node in module.body if module else []:
            if isinstance(node, ast.FunctionDef) and any(
                _decorator_name(d) == "register_op" for d in node.decorator_list
            ):
                ops.append(node.name)
    return sorted(ops)


def register_impl_keywords(tree: VllmTree) -> list[str] | None:
    """The parameters of ``IrOp.register_impl`` after ``self``; None when absent."""
    module = _parse(tree, IR_OP_FILE)
    for cls in module.body if module else []:
        if isinstance(cls, ast.ClassDef) and cls.name == "IrOp":
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "register_impl":
                    a = fn.args
                    return [x.arg for x in (a.posonlyargs + a.args + a.kwonlyargs)][1:]
    return None


def priority_config_fields(tree: VllmTree) -> tuple[str, list[str]] | None:
    """(file, annotated fields) of ``class IrOpPriorityConfig``; None when absent."""
    candidates = list(CONFIG_FILES) + _names(tree, "vllm/config")
    for rel in dict.fromkeys(candidates):
        module = _parse(tree, rel)
        for cls in module.body if module else []:
            if isinstance(cls, ast.ClassDef) and cls.name == "IrOpPriorityConfig":
                fields = [
                    n.target.id
                    for n in cls.body
                    if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                ]
                return rel, fields
    return None


def vllm_c_gates(tree: VllmTree) -> dict[str, str]:
    """op -> the source of its ``supported=`` gate, for each ``vllm_c`` impl,
    as the patch's own codemod reads them."""
    if not tree.exists(VLLM_C_FILE):
        return {}
    try:
        module = cst.parse_module(tree.read_text(VLLM_C_FILE))
    except (PatchError, cst.ParserSyntaxError):
        return {}
    code = cst.Module([]).code_for_node
    return {
        i.op: code(i.supported) if i.supported is not None else "True"
        for i in patched_impls(module)
    }


# --- what the provider needs ---------------------------------------------------


def provider_source(module: str = PROVIDER_MODULE) -> Path | None:
    """The provider's source file, found without running it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return (
        Path(spec.origin)
        if spec and spec.origin and spec.origin.endswith(".py")
        else None
    )


def provider_needs(source: str) -> dict[str, list[str]]:
    """IR ops and ``register_impl`` keywords the provider uses.

    ``ops.NAME`` attribute access and keywords spelled at a ``register_impl``
    call are required; an op or keyword that appears only as a string (in
    ``getattr(ops, "x", None)``, ``hasattr``, a ``kwargs`` dict) is optional:
    the provider checks for it before use.
    """
    module = ast.parse(source)
    ops: set[str] = set()
    keywords: set[str] = set()
    strings: set[str] = set()
    for node in ast.walk(module):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "ops"
            and _root_name(node.value) in ("ir", "vllm")
        ):
            ops.add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "register_impl"
        ):
            keywords.update(k.arg for k in node.keywords if k.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            strings.add(node.value)
    return {
        "ops": sorted(ops),
        "keywords": sorted(keywords),
        "strings": sorted(strings),
    }


def _root_name(node: ast.expr) -> str:
    while isinstance(node, ast.Attribute):
        node = node.value
    return getattr(node, "id", "")


# --- the checks ----------------------------------------------------------------


def predates_ir(tree: VllmTree) -> str | None:
    """Why the tree has no IR when it is a release from before IR, else None
    (a newer tree without ``vllm/ir/op.py`` is a failure, not this)."""
    from compat_matrix.versions import FIRST_IR

    version = read_version(tree)
    if tree.exists(IR_OP_FILE) or version is None or version >= FIRST_IR:
        return None
    return f"vLLM {version} predates vLLM IR (first in {FIRST_IR}): not applicable"


def check_ir(tree: VllmTree) -> dict[str, Any]:
    if reason := predates_ir(tree):
        return _check("wheel_ir", CheckStatus.SKIP, reason)
    if not tree.exists(IR_OP_FILE):
        return _check(
            "wheel_ir", CheckStatus.FAIL, f"no {IR_OP_FILE}: this vLLM has no IR"
        )
    ops = ir_ops(tree)
    return _check(
        "wheel_ir",
        CheckStatus.PASS,
        "",
        ops=ops,
        vllm_c=vllm_c_gates(tree),
        register_impl=register_impl_keywords(tree),
    )


def check_priority_config(tree: VllmTree) -> dict[str, Any]:
    found = priority_config_fields(tree)
    if found is None:
        return _check(
            "wheel_priority_config", CheckStatus.FAIL, "no class IrOpPriorityConfig"
        )
    rel, fields = found
    if "priorities" in fields:  # one upstream branch: priorities: dict[str, list[str]]
        return _check(
            "wheel_priority_config",
            CheckStatus.PASS,
            "per-op dict (priorities)",
            file=rel,
            fields=fields,
        )
    missing = [op for op in ir_ops(tree) if op not in fields]
    status = CheckStatus.FAIL if missing else CheckStatus.PASS
    reason = f"no priority field for IR op(s) {', '.join(missing)}" if missing else ""
    return _check("wheel_priority_config", status, reason, file=rel, fields=fields)


def check_provider_api(
    tree: VllmTree, provider: str = PROVIDER_MODULE
) -> dict[str, Any]:
    source = provider_source(provider)
    if source is None:
        return _check(
            "provider_api", CheckStatus.SKIP, f"provider module {provider} not found"
        )
    needs = provider_needs(source.read_text("utf-8"))
    have_ops = set(ir_ops(tree))
    have_kw = set(register_impl_keywords(tree) or [])
    missing_ops = [o for o in needs["ops"] if o not in have_ops]
    missing_kw = [k for k in needs["keywords"] if k not in have_kw]
    # Ops/keywords the provider names only as strings are guarded: note, not fail.
    optional = sorted(
        s
        for s in needs["strings"]
        if s in {"fused_add_rms_norm", "rms_norm", "inplace", "supports_args"}
        and s not in have_ops | have_kw
    )
    details = {
        "provider": str(source),
        "needs": {k: needs[k] for k in ("ops", "keywords")},
        "optional_missing": optional,
    }
    if missing_ops or missing_kw:
        parts = ([f"IR op(s) {', '.join(missing_ops)}"] if missing_ops else []) + (
            [f"register_impl keyword(s) {', '.join(missing_kw)}"] if missing_kw else []
        )
        return _check(
            "provider_api",
            CheckStatus.FAIL,
            f"provider uses {' and '.join(parts)}, which this vLLM lacks",
            **details,
        )
    reason = f"degrades: no {', '.join(optional)} here" if optional else ""
    return _check("provider_api", CheckStatus.PASS, reason, **details)


def check_patches(tree: VllmTree) -> list[dict[str, Any]]:
    """``vllm-patch check`` per carried patch; pass = applies (or already applied)."""
    checks = []
    pre_ir = predates_ir(tree)
    for patch in all_patches():
        name = f"patch:{patch.name}"
        if pre_ir:  # every carried patch edits vLLM IR code
            checks.append(
                _check(
                    name,
                    CheckStatus.SKIP,
                    pre_ir,
                    plan_status=PlanStatus.NOT_APPLICABLE,
                )
            )
            continue
        try:
            p = plan(tree, patch, "apply")
        except PatchError as exc:
            checks.append(_check(name, CheckStatus.FAIL, exc.message, error=str(exc)))
            continue
        diff = p.diff()
        details = {
            "plan_status": p.status,
            "plan": p.to_json(),
            "diff_lines": {"added": _count(diff, "+"), "removed": _count(diff, "-")},
        }
        if p.errors:
            first = p.errors[0]
            checks.append(
                _check(
                    name, CheckStatus.FAIL, f"{p.status}: {first.message}", **details
                )
            )
        else:
            checks.append(_check(name, CheckStatus.PASS, p.status, **details))
    return checks


def _count(diff: str, sign: str) -> int:
    return sum(
        1
        for line in diff.splitlines()
        if line.startswith(sign) and not line.startswith(sign * 3)
    )


def _timed(name: str, fn: Callable[[], Any]) -> list[dict[str, Any]]:
    start = time.perf_counter()
    try:
        out = fn()
    except Exception as exc:  # one broken check must not hide the others
        out = _check(name, CheckStatus.FAIL, f"{type(exc).__name__}: {exc}")
    checks = out if isinstance(out, list) else [out]
    spent = round(time.perf_counter() - start, 3)
    for c in checks:
        c["seconds"] = spent / len(checks)
    return checks


def check_wheel(path: str | Path, provider: str = PROVIDER_MODULE) -> dict[str, Any]:
    """All static checks on one wheel or tree: ``{"vllm": ..., "checks": [...]}``."""
    tree = open_tree(path)
    version = read_version(tree)
    checks: list[dict[str, Any]] = []
    checks += _timed("wheel_ir", lambda: check_ir(tree))
    if tree.exists(IR_OP_FILE):
        checks += _timed("wheel_priority_config", lambda: check_priority_config(tree))
        checks += _timed("provider_api", lambda: check_provider_api(tree, provider))
    else:  # said, so that the matrix has a mark with a reason in their columns
        no_ir = f"not run: {checks[0]['reason']}"
        checks += [_check(n, CheckStatus.SKIP, no_ir) for n in IR_CHECKS]
    checks += _timed("patch", lambda: check_patches(tree))
    return {
        "vllm": {
            "version": str(version) if version else None,
            "location": Path(path).name,  # no folder of this machine in a result
        },
        "checks": checks,
        "ok": all(c["status"] != CheckStatus.FAIL for c in checks),
    }


if __name__ == "__main__":
    import json
    import sys

    result = check_wheel(sys.argv[1], *sys.argv[2:3])
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["ok"] else 1)
