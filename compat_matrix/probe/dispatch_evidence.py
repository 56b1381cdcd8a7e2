"""Which impl vLLM's dispatch actually runs for one IR op: the probe's own
evidence, beside the numerics (``vllm_patch.bench.numerics``, the one comparison against
native, whose ``compare_impl`` and ``noncontiguous_dispatch`` the checks run).
"""

from __future__ import annotations

from typing import Any

from vllm_patch.bench.numerics import DISPATCH_SHAPE, as_tuple, copy_args, op_inputs


def dispatch_evidence(op, provider: str) -> dict:
    """Which impl ran: the provider's function is wrapped to count its calls while
    the op is called through vLLM's own entry points (the torch op, and the
    in-place overload where there is one), the values that come back must be the
    provider's own (numerics, not this, judges them against native), and the
    profiler names the kernels."""
    import torch

    impl = op.impls[provider]
    original = impl.impl_fn
    calls: list[str] = []

    def counted(*args, **kwargs):
        calls.append(provider)
        return original(*args, **kwargs)

    args = op_inputs(op, DISPATCH_SHAPE, torch.bfloat16)
    own = as_tuple(original(*copy_args(args)))
    entry_points = {"op": op}
    if getattr(op, "maybe_inplace", None) is not None and getattr(
        impl, "inplace", False
    ):
        entry_points["op.maybe_inplace"] = op.maybe_inplace
    result: dict[str, Any] = {"calls": {}, "kernels": [], "returns_provider_values": {}}
    impl.impl_fn = counted
    try:
        with op.set_priority([provider, "native"]):
            result["dispatched_to"] = op.dispatch(*args).provider
            for label, entry in entry_points.items():
                before = len(calls)
                with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU]
                ) as prof:
                    got = as_tuple(entry(*copy_args(args)))
                result["calls"][label] = len(calls) - before
                result["kernels"] += sorted(
                    {e.name for e in prof.events() if e.name.startswith("_C::")}
                )
                result["returns_provider_values"][label] = len(got) == len(own) and all(
                    torch.equal(g, o) for g, o in zip(got, own, strict=False)
                )
        before = len(calls)
        with op.set_priority(["native"]):
            op(*copy_args(args))
        result["calls_under_native"] = len(calls) - before
    finally:
        impl.impl_fn = original
    result["kernels"] = sorted(set(result["kernels"]))
    result["ok"] = (
        result["dispatched_to"] == provider
        and all(n == 1 for n in result["calls"].values())
        and all(result["returns_provider_values"].values())
        and result["calls_under_native"] == 0
    )
    return result
