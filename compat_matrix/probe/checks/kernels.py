"""Can this environment run the provider's kernels, are their answers right, and
does vLLM's dispatch actually call them.
"""

from __future__ import annotations

from typing import Any

from compat_matrix.probe.dispatch_evidence import dispatch_evidence
from compat_matrix.probe.framework import (
    Fail,
    Probe,
    Skip,
    need_kernels,
    need_provider,
)
from compat_matrix.probe.provider_module import provider_status
from compat_matrix.probe.vllm_ir import NORM_OPS, has_c_op
from vllm_patch.bench.numerics import (
    DTYPE_NAMES,
    SHAPES,
    compare_impl,
    noncontiguous_dispatch,
)


def check_kernels_supported(p: Probe) -> tuple[str, dict]:
    need_provider(p)
    from vllm.ir.op import IrOp

    supported = {op: bool(IrOp.registry[op].impls[p.name].supported) for op in p.ops}
    env = kernel_environment()
    status = provider_status(p.module) or {}
    details = {
        "supported": supported,
        "environment": env,
        "provider_reasons": status.get("unsupported_reasons", {}),
    }
    missing = _kernels_missing(env, p.ops)
    if all(supported.values()):
        if missing:
            raise Fail(f"{p.name!r} claims support, but {missing}", details)
        p.kernels_unavailable = None
        return (
            f"{p.name!r} supported for {', '.join(p.ops)} ({env['platform']})",
            details,
        )
    off = [op for op, yes in supported.items() if not yes]
    why = "; ".join(details["provider_reasons"].get(op, "") for op in off).strip("; ")
    p.kernels_unavailable = missing or why or "unsupported"
    if missing:  # this environment cannot run the kernels: not the provider's fault
        raise Skip(f"{p.name!r} unsupported for {', '.join(off)}: {missing}", details)
    raise Fail(
        f"{p.name!r} reports unsupported for {', '.join(off)} although the platform "
        f"is CPU and the _C kernels are present{': ' + why if why else ''}",
        details,
    )


def kernel_environment() -> dict[str, Any]:
    """The platform and the C kernels, described independently of any provider."""
    import torch
    from vllm.platforms import current_platform

    env: dict[str, Any] = {
        "platform": type(current_platform).__name__,
        "is_cpu": bool(current_platform.is_cpu()),
    }
    try:
        current_platform.import_kernels()  # logs and swallows its own ImportError
    except Exception as exc:
        env["import_kernels_error"] = f"{type(exc).__name__}: {exc}"
    env["c_ops"] = {op: has_c_op(torch, op) for op in NORM_OPS}
    if not all(env["c_ops"].values()):
        try:
            import vllm._C  # noqa: F401

            env["c_import_error"] = None
        except ImportError as exc:
            env["c_import_error"] = str(exc)
    return env


def _kernels_missing(env: dict, ops: list[str]) -> str | None:
    if not env["is_cpu"]:
        return f"platform is {env['platform']}, not CPU"
    absent = [op for op in ops if op in env["c_ops"] and not env["c_ops"][op]]
    if not absent:
        return None
    if env.get("c_import_error"):
        return f"vllm._C does not load: {env['c_import_error']}"
    return f"vllm._C has no {', '.join(absent)}"


def truncation_note(cases: list[dict]) -> str:
    """What the bfloat16 cases explained by truncation add to a verdict."""
    truncating = [c for c in cases if "truncates_bf16" in c]
    if not truncating:
        return ""
    worst = max(max(c["max_abs_diff"]) for c in truncating)
    return (
        f"; but on this CPU the kernels truncate to bfloat16 where torch rounds: "
        f"{len(truncating)} bfloat16 case(s) are off native "
        f"by up to {worst:g}, outside op.get_tolerance, all of it the truncation "
        "(the same shapes are right in float32)"
    )


def check_provider_numerics(p: Probe) -> tuple[str, dict]:
    need_kernels(p)
    from vllm.ir.op import IrOp

    cases, routing = [], {}
    for op_name in p.ops:
        op = IrOp.registry[op_name]
        cases += compare_impl(op, p.name)
        routing[op_name] = noncontiguous_dispatch(op, p.name)
    details = {"cases": cases, "non_contiguous": routing}
    bad = [c for c in cases if not c["ok"]]
    if bad:
        first = bad[0]
        raise Fail(
            f"{len(bad)}/{len(cases)} cases off; first: {first['op']} {first['dtype']} "
            f"{first['shape']}: {first.get('error') or first['max_abs_diff']}",
            details,
        )
    misrouted = [op for op, r in routing.items() if not r["ok"]]
    if misrouted:
        raise Fail(
            f"non-contiguous input not routed to native: {', '.join(misrouted)}",
            details,
        )
    inplace = [c["op"] for c in cases if c.get("inplace")]
    return (
        f"{sum('truncates_bf16' not in c for c in cases)} of {len(cases)} cases "
        f"within op.get_tolerance ({', '.join(DTYPE_NAMES)}; "
        f"shapes {', '.join(str(list(s)) for s in SHAPES)}; weight None)"
        + ("; in place: both tensors updated" if inplace else "")
        + "; non-contiguous input goes to native"
        + truncation_note(cases),
        details,
    )


def check_dispatch(p: Probe) -> tuple[str, dict]:
    need_kernels(p)
    from vllm.ir.op import IrOp

    results = {op: dispatch_evidence(IrOp.registry[op], p.name) for op in p.ops}
    bad = [op for op, r in results.items() if not r["ok"]]
    if bad:
        raise Fail(
            f"{p.name!r} did not run under set_priority for {', '.join(bad)}", results
        )
    kernels = sorted({k for r in results.values() for k in r["kernels"]})
    return (
        f"under set_priority([{p.name!r}, 'native']) every call ran {p.name!r} "
        f"(kernels: {', '.join(kernels) or 'none recorded'}); "
        "under ['native'] none did",
        results,
    )
