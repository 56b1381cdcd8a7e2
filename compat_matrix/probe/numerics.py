"""Numerics and dispatch evidence for one IR op and one provider, judged against
the op's own ``native`` impl on the op's own generated inputs. Shared by the
checks (the provider under test) and the patched-copy child (upstream's
``vllm_c``); it knows nothing of either.
"""

from __future__ import annotations

import inspect
from typing import Any

DTYPE_NAMES = ("float32", "bfloat16")
SHAPES = ((1, 2048), (16, 4096), (2, 8, 2048))
WEIGHTLESS_SHAPE = (16, 4096)  # the shape that also runs with weight=None
DISPATCH_SHAPE = (16, 2048)


def _activation_indices(op) -> list[int]:
    found = getattr(op, "activation_indices", None)
    if found is not None:
        return list(found)
    params = inspect.signature(op.impls["native"].impl_fn).parameters
    return [i for i, name in enumerate(params) if name.startswith("x")]


def _weight_index(op) -> int | None:
    params = list(inspect.signature(op.impls["native"].impl_fn).parameters)
    return params.index("weight") if "weight" in params else None


def op_inputs(op, shape, dtype, *, weighted: bool = True) -> list:
    """The op's own generated inputs for ``shape`` (leading dims flattened into
    tokens, then restored on the activations)."""
    import torch

    torch.manual_seed(0)
    tokens = 1
    for d in shape[:-1]:
        tokens *= d
    args = list(
        op.generate_inputs(num_tokens=tokens, hidden_size=shape[-1], dtype=dtype)
    )
    for i in _activation_indices(op):
        args[i] = args[i].reshape(shape)
    w = _weight_index(op)
    if not weighted and w is not None:
        args[w] = None
    return args


def _clone(args: list) -> list:
    import torch

    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def compare_impl(op, provider: str) -> list[dict]:
    """Provider vs native within ``op.get_tolerance(dtype)``; for in-place impls
    also that the returned tensors are the caller's, updated."""
    import torch

    cases = []
    for dtype_name in DTYPE_NAMES:
        dtype = getattr(torch, dtype_name)
        for shape in SHAPES:
            variants = (True, False) if shape == WEIGHTLESS_SHAPE else (True,)
            for weighted in variants:
                case = {
                    "op": op.name,
                    "dtype": dtype_name,
                    "shape": list(shape),
                    "weight": weighted,
                }
                try:
                    case.update(_compare_case(op, provider, shape, dtype, weighted))
                except Exception as exc:
                    case.update(ok=False, error=f"{type(exc).__name__}: {exc}")
                cases.append(case)
    return cases


def _compare_case(op, provider: str, shape, dtype, weighted: bool) -> dict:
    import torch

    impl, native = op.impls[provider], op.impls["native"]
    args = op_inputs(op, shape, dtype, weighted=weighted)
    expected = _as_tuple(native.impl_fn(*_clone(args)))
    given = _clone(args)
    actual = _as_tuple(impl.impl_fn(*given))
    tol = op.get_tolerance(dtype)
    out: dict[str, Any] = {"atol": tol["atol"], "rtol": tol["rtol"], "max_abs_diff": []}
    ok = len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=False):  # lengths checked above
        ok = ok and a.shape == e.shape and a.dtype == e.dtype
        out["max_abs_diff"].append(float((a.float() - e.float()).abs().max()))
        try:
            torch.testing.assert_close(a, e, atol=tol["atol"], rtol=tol["rtol"])
        except AssertionError as exc:
            ok = False
            out.setdefault("error", str(exc).splitlines()[0])
    if getattr(impl, "inplace", False):
        # The outputs are the activations, updated in place (x, then x_residual).
        same = [
            actual[k].data_ptr() == given[i].data_ptr()
            and given[i].shape == tuple(shape)
            for k, i in enumerate(_activation_indices(op))
        ]
        out["inplace"] = {"outputs_are_inputs": all(same)}
        ok = ok and all(same)
    out["ok"] = bool(ok)
    return out


def functional(impl):
    """The impl's out-of-place form: ``func_impl_fn`` where vLLM has in-place
    impls (0.24 on), else ``impl_fn`` itself (0.20 has only that, and no impl
    there works in place)."""
    return getattr(impl, "func_impl_fn", None) or impl.impl_fn


def _as_tuple(result) -> tuple:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _strided_layouts(tensor) -> dict:
    """The same values in layouts vLLM can hand a norm: transposed strides, and a
    view into a wider row (as q/k/v splits of a fused projection give)."""
    import torch

    wide = torch.cat([torch.zeros_like(tensor), tensor], dim=-1)
    return {
        "transposed": tensor.t().contiguous().t(),
        "row_strided": wide[..., tensor.shape[-1] :],
    }


def noncontiguous_dispatch(op, provider: str) -> dict:
    """Under ``[provider, "native"]``: where non-contiguous activations go, and
    whether the op's answer for them is still right (the CPU kernels assume
    contiguous rows and return wrong values otherwise)."""
    import torch

    args = op_inputs(op, DISPATCH_SHAPE, torch.bfloat16)
    expected = _as_tuple(op.impls["native"].impl_fn(*_clone(args)))
    tol = op.get_tolerance(torch.bfloat16)
    out: dict[str, Any] = {}
    with op.set_priority([provider, "native"]):
        out["contiguous"] = op.dispatch(*args).provider
        layouts: dict[str, list] = {}
        for i in _activation_indices(op):
            for name, view in _strided_layouts(args[i]).items():
                layouts.setdefault(name, list(args))[i] = view
        for name, strided in layouts.items():
            impl = op.dispatch(*strided)
            got = _as_tuple(functional(impl)(*strided))
            diffs = [
                float((g.float() - e.float()).abs().max())
                for g, e in zip(got, expected, strict=False)
            ]
            right = all(
                torch.allclose(g.float(), e.float(), atol=tol["atol"], rtol=tol["rtol"])
                for g, e in zip(got, expected, strict=False)
            )
            out[name] = {
                "dispatched_to": impl.provider,
                "max_abs_diff": diffs,
                "right": right,
            }
    out["ok"] = out["contiguous"] == provider and all(
        out[name]["dispatched_to"] == "native" and out[name]["right"]
        for name in layouts
    )
    return out


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
    own = _as_tuple(original(*_clone(args)))
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
                    got = _as_tuple(entry(*_clone(args)))
                result["calls"][label] = len(calls) - before
                result["kernels"] += sorted(
                    {e.name for e in prof.events() if e.name.startswith("_C::")}
                )
                result["returns_provider_values"][label] = len(got) == len(own) and all(
                    torch.equal(g, o) for g, o in zip(got, own, strict=False)
                )
        before = len(calls)
        with op.set_priority(["native"]):
            op(*_clone(args))
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
