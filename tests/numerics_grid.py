"""The provider's IR implementations against native on a grid of dtypes and
shapes, strided inputs through IR dispatch, and telling a kernel that truncates
to bfloat16 from one that rounds: test helpers over vllm_patch.bench.numerics's
one comparison."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vllm_patch.bench.numerics import (
    activation_indices,
    as_tuple,
    compare,
    copy_args,
    expected_of,
    op_inputs,
)
from vllm_patch.runtime.bench_result import NATIVE

DTYPE_NAMES = ("float32", "bfloat16")
SHAPES = ((1, 2048), (16, 4096), (2, 8, 2048))
WEIGHTLESS_SHAPE = (16, 4096)  # the shape that also runs with weight=None
DISPATCH_SHAPE = (16, 2048)


def compare_impl(op, provider: str) -> list[dict]:
    """``provider``'s impl against native on a grid of dtypes and shapes (one
    without a weight), each within ``op.get_tolerance(dtype)``; for an in-place
    impl also that the returned tensors are the caller's, updated."""
    import torch

    impl = op.impls[provider]
    inplace = activation_indices(op) if getattr(impl, "inplace", False) else ()
    cases = []
    for dtype_name in DTYPE_NAMES:
        dtype = getattr(torch, dtype_name)
        tol = op.get_tolerance(dtype)
        for shape in SHAPES:
            for weighted in (True, False) if shape == WEIGHTLESS_SHAPE else (True,):
                case = {
                    "op": op.name,
                    "dtype": dtype_name,
                    "shape": list(shape),
                    "weight": weighted,
                    "atol": tol["atol"],
                    "rtol": tol["rtol"],
                }
                try:
                    args = op_inputs(op, shape, dtype, weighted=weighted)
                    found = compare(
                        impl.impl_fn, args, expected_of(op, args), tol, inplace=inplace
                    )
                except Exception as exc:  # the inputs or native itself failed
                    found = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                case.update(found)
                cases.append(case)
    explain_truncation(op, impl, cases)
    return cases


def truncated_share(fn: Callable, args: Sequence[Any]) -> float | None:
    """How far ``fn`` truncates to bfloat16 instead of rounding: of the output
    elements where the two differ, the share equal to ``fn``'s own float32
    result (the same inputs, widened) with its low 16 bits dropped. About 1.0
    for a kernel that truncates, about 0.0 for one that rounds as torch does;
    None when the inputs are not bfloat16 or no element tells them apart."""
    import torch

    if not any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args):
        return None
    wide = tuple(
        a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        for a in args
    )
    narrow_out = [o for o in as_tuple(fn(*copy_args(args))) if torch.is_tensor(o)]
    wide_out = [o for o in as_tuple(fn(*copy_args(wide))) if torch.is_tensor(o)]
    telling = truncated = 0
    for got, exact in zip(narrow_out, wide_out, strict=False):
        rounded = exact.to(torch.bfloat16)
        dropped = (exact.view(torch.int32) & -65536).view(torch.float32)
        dropped = dropped.to(torch.bfloat16)
        differ = rounded != dropped
        telling += int(differ.sum())
        truncated += int((got == dropped)[differ].sum())
    return truncated / telling if telling else None


def explain_truncation(op, impl, cases: list[dict]) -> None:
    """Mark the bfloat16 cases that miss native only because the kernel
    truncates to bfloat16 (vLLM's x86 CPU kernels convert that way, measured
    with its AVX2 and AVX-512 libraries; torch rounds to nearest), so that the
    deviation is reported, not mistaken for a wrong implementation. A case is
    explained when the implementation gets the same shape right in float32 and,
    of its bfloat16 outputs where truncating and rounding differ, more than
    ``TRUNCATION_SHARE`` are its own float32 result truncated; anything else
    stays a failure.
    """
    import torch

    right_in_fp32 = {
        (tuple(c["shape"]), c["weight"])
        for c in cases
        if c["dtype"] == "float32" and c["ok"]
    }
    for case in cases:
        key = (tuple(case["shape"]), case["weight"])
        if case["ok"] or case["dtype"] != "bfloat16" or key not in right_in_fp32:
            continue
        args = op_inputs(op, case["shape"], torch.bfloat16, weighted=case["weight"])
        share = truncated_share(impl.impl_fn, args)
        if share is not None and share > TRUNCATION_SHARE:
            case.update(ok=True, truncates_bf16=round(share, 4))


# Above this share of telling elements truncated, a kernel truncates: a kernel
# that rounds matches truncation on at most the few elements its float32 math
# puts on the other side of a rounding boundary.
TRUNCATION_SHARE = 0.9


def functional(impl):
    """The impl's out-of-place form: ``func_impl_fn`` where vLLM has in-place
    impls (0.24 on), else ``impl_fn`` itself (0.20 has only that, and no impl
    there works in place)."""
    return getattr(impl, "func_impl_fn", None) or impl.impl_fn


def strided_layouts(tensor) -> dict:
    """The same values in layouts vLLM can hand a norm: transposed strides, and a
    view into a wider row (as q/k/v splits of a fused projection give)."""
    import torch

    wide = torch.cat([torch.zeros_like(tensor), tensor], dim=-1)
    return {
        "transposed": tensor.t().contiguous().t(),
        "row_strided": wide[..., tensor.shape[-1] :],
    }


def noncontiguous_dispatch(op, provider: str, shape=DISPATCH_SHAPE) -> dict:
    """Under ``[provider, "native"]``: where non-contiguous activations go, and
    whether the op's answer for them is still right (the CPU kernels assume
    contiguous rows and return wrong values otherwise)."""
    import torch

    args = op_inputs(op, shape, torch.bfloat16)
    expected = expected_of(op, args)
    tol = op.get_tolerance(torch.bfloat16)
    out: dict[str, Any] = {}
    with op.set_priority([provider, NATIVE]):
        out["contiguous"] = op.dispatch(*args).provider
        layouts: dict[str, list] = {}
        for i in activation_indices(op):
            for name, view in strided_layouts(args[i]).items():
                layouts.setdefault(name, list(args))[i] = view
        for name, strided in layouts.items():
            impl = op.dispatch(*strided)
            found = compare(functional(impl), strided, expected, tol)
            out[name] = {
                "dispatched_to": impl.provider,
                "max_abs_diff": found["max_abs_diff"],
                "right": found["ok"],
            }
    out["ok"] = out["contiguous"] == provider and all(
        out[name]["dispatched_to"] == NATIVE and out[name]["right"] for name in layouts
    )
    return out
