"""The doctor's import checks in a child (``run_steps``), each step reported once
done, so that the parent knows which one took a crashed child down: ``["import",
MODULE]``, ``["from", "MODULE:NAME"]``, ``["provider", MODULE]``, ``["kernels",
"vllm"]``."""

from __future__ import annotations

import importlib
import traceback
from typing import Any

# What a provider module may declare about itself; reported as they are.
PROVIDER_ATTRIBUTES = ("PROVIDER", "UPSTREAM_PROVIDER", "OPS", "OPT_IN_ENV")


def describe_error(exc: BaseException) -> dict[str, Any]:
    """``error``, ``root_error`` (the innermost cause: what actually broke) and
    ``packages``: the top-level packages of the chain's frames, innermost last."""
    chain: list[BaseException] = []
    while exc is not None and not any(e is exc for e in chain):
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    packages = {
        str(frame.f_globals.get("__name__", "")).split(".")[0]: None
        for e in chain
        for frame, _ in traceback.walk_tb(e.__traceback__)
    }
    said = [f"{type(e).__name__}: {e}".strip() for e in chain]
    found = {"error": said[0], "root_error": said[-1]}
    return found | {"packages": [*filter(None, packages)]}


def run_step(kind: str, arg: str) -> dict[str, Any]:
    try:
        if kind == "import":
            module = importlib.import_module(arg)
            return {"version": getattr(module, "__version__", None)}
        if kind == "from":
            module_name, _, name = arg.partition(":")
            getattr(importlib.import_module(module_name), name)
            return {}
        if kind == "provider":
            return _provider(arg)
        if kind == "kernels":
            return _vllm_kernels()
        raise ValueError(f"unknown step kind {kind!r}")
    except BaseException as exc:  # SystemExit from a C extension is a finding too
        return {"ok": False, **describe_error(exc)}


def _provider(module_name: str) -> dict[str, Any]:
    module = importlib.import_module(module_name)
    attributes = {a: getattr(module, a, None) for a in PROVIDER_ATTRIBUTES}
    out: dict[str, Any] = {"attributes": attributes}
    register = getattr(module, "register", None)
    if not callable(register):
        return {"ok": False, "error": f"{module_name} has no register()", **out}
    register()
    status = getattr(module, "status", None)
    out["status"] = status() if callable(status) else None
    return out


def load_vllm_kernels() -> str | None:
    """Load vLLM's C kernels through the platform (which picks the x86 build
    the CPU runs); vLLM logs and swallows a failed load: what it logged."""
    import logging.handlers

    from vllm.platforms import current_platform

    keep, log = logging.handlers.BufferingHandler(10_000), logging.getLogger("vllm")
    keep.setLevel(logging.WARNING)
    log.addHandler(keep)
    try:
        current_platform.import_kernels()
    finally:
        log.removeHandler(keep)
    return keep.buffer[-1].getMessage() if keep.buffer else None


def _vllm_kernels() -> dict[str, Any]:  # loaded: some ``_C::`` operator exists
    import torch

    logged = load_vllm_kernels()
    ops = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("_C::")]
    if not ops:
        why = logged or "no _C:: operator was registered"
        return {"ok": False, "error": why, "root_error": why, "packages": ["vllm"]}
    return {"operators": len(ops)}


def run_steps(steps: list[list[str]]) -> int:
    """The child's side: each step's result reported when known
    (``{"step": [kind, arg], "ok": ..., ...}``); how many steps ran."""
    from vllm_patch.runtime.child import report

    for kind, arg in steps:
        report({"step": [kind, arg], "ok": True, **run_step(kind, arg)})
    return len(steps)
