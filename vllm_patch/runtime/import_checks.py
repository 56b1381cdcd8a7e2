"""The doctor's import checks in a child (``run_steps``, the kinds ``STEPS``),
each reported once done: the parent knows which one took a crashed child down."""

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


def _import(arg: str) -> dict[str, Any]:
    """``MODULE`` (its version) or ``MODULE:NAME`` (the name must exist)."""
    module, _, name = arg.partition(":")
    found = importlib.import_module(module)
    if name:
        getattr(found, name)
    return {"version": getattr(found, "__version__", None)}


def _provider(module_name: str) -> dict[str, Any]:
    module = importlib.import_module(module_name)
    attributes = {a: getattr(module, a, None) for a in PROVIDER_ATTRIBUTES}
    out: dict[str, Any] = {"attributes": attributes}
    register = getattr(module, "register", None)
    if not callable(register):
        return {"ok": False, "error": f"{module_name} has no register()", **out}
    register()
    status = getattr(module, "status", None)
    return out | {"status": status() if callable(status) else None}


def _kernels(_: str) -> dict[str, Any]:
    """vLLM's C kernels loaded through the platform (which picks the x86 build
    the CPU runs): some ``_C::`` operator exists, else what vLLM logged (it
    swallows a failed load)."""
    import logging.handlers

    import torch
    from vllm.platforms import current_platform

    keep, log = logging.handlers.BufferingHandler(10_000), logging.getLogger("vllm")
    keep.setLevel(logging.WARNING)
    log.addHandler(keep)
    try:
        current_platform.import_kernels()
    finally:
        log.removeHandler(keep)
    ops = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("_C::")]
    if not ops:
        said = [record.getMessage() for record in keep.buffer]
        why = (said or ["no _C:: operator was registered"])[-1]
        return {"ok": False, "error": why, "root_error": why, "packages": ["vllm"]}
    return {"operators": len(ops)}


STEPS = {"import": _import, "from": _import, "provider": _provider, "kernels": _kernels}


def run_steps(steps: list[list[str]]) -> int:
    """The child's side: each step's result reported when known
    (``{"step": [kind, arg], "ok": ..., ...}``); how many steps ran."""
    from vllm_patch.runtime.child import report

    for kind, arg in steps:
        try:
            found = STEPS[kind](arg)
        except BaseException as exc:  # SystemExit from a C extension is a finding too
            found = {"ok": False, **describe_error(exc)}
        report({"step": [kind, arg], "ok": True, **found})
    return len(steps)
