"""Numerics of an IR implementation against the op's own ``native`` one.

:func:`compare` is the one comparison: call an implementation on a copy of the
inputs and hold every output tensor to native's (same count, shapes, dtypes,
within the op's own ``get_tolerance``), and, for an in-place implementation,
check that the outputs are the caller's tensors. The bench checks every
implementation with it before timing it; :func:`compare_impl` (a grid of
dtypes and shapes, weightless included) and :func:`noncontiguous_dispatch`
(strided inputs through IR dispatch) build the probe's evidence on it.
Inputs always come from the op's own generator (:func:`op_inputs`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from patches.cpu_fused_norms.identity import OPS
from vllm_patch.runtime.bench_result import NATIVE

DTYPE_NAMES = ("float32", "bfloat16")
SHAPES = ((1, 2048), (16, 4096), (2, 8, 2048))
WEIGHTLESS_SHAPE = (16, 4096)  # the shape that also runs with weight=None
DISPATCH_SHAPE = (16, 2048)


def copy_args(args: Sequence[Any]) -> tuple:
    """Each tensor copied with its strides (a view into a wider row stays one),
    the rest as is: an implementation may write into its inputs."""
    import torch

    return tuple(
        torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device).copy_(
            a
        )
        if isinstance(a, torch.Tensor)
        else a
        for a in args
    )


def as_tuple(result: Any) -> tuple:
    """An implementation's outputs: a tensor, or a tuple or list of them."""
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def compare(
    fn: Callable,
    args: Sequence[Any],
    expected: Any,
    tolerance: dict[str, float],
    *,
    inplace: Sequence[int] = (),
) -> dict[str, Any]:
    """Call ``fn`` on a copy of ``args`` and hold its output tensors to
    ``expected`` (native's on the same inputs): ``ok``, ``max_abs_diff`` per
    output, ``max_abs_err`` (the largest; None when none could be compared) and
    ``error`` (the first reason it is not ok). ``inplace``: the argument
    indices whose tensors the outputs must be, in order (an in-place impl
    returns the activations it updated); adds ``inplace``."""
    import torch

    given = copy_args(args)
    out: dict[str, Any] = {"ok": False, "max_abs_diff": [], "max_abs_err": None}
    try:
        actual = as_tuple(fn(*given))
    except Exception as exc:
        return {**out, "error": f"raised {type(exc).__name__}: {exc}"}
    got = [a for a in actual if isinstance(a, torch.Tensor)]
    want = [e for e in as_tuple(expected) if isinstance(e, torch.Tensor)]
    if len(got) != len(want):
        return {**out, "error": f"{len(got)} output tensors, native gives {len(want)}"}
    error = None
    for a, e in zip(got, want, strict=True):
        if a.shape != e.shape or a.dtype != e.dtype:
            error = (
                error or f"output {a.dtype}{list(a.shape)} != {e.dtype}{list(e.shape)}"
            )
            continue
        diff = (a.float() - e.float()).abs()
        out["max_abs_diff"].append(float(diff.max()) if diff.numel() else 0.0)
        try:
            torch.testing.assert_close(a, e, **tolerance)
        except AssertionError as exc:
            first = str(exc).strip().splitlines()[0]
            error = error or f"outside tolerance {tolerance}: {first}"
    if out["max_abs_diff"]:
        out["max_abs_err"] = max(out["max_abs_diff"])
    if inplace:
        same = len(got) >= len(inplace) and all(
            got[k].data_ptr() == given[i].data_ptr() for k, i in enumerate(inplace)
        )
        out["inplace"] = {"outputs_are_inputs": same}
        if not same:
            error = error or "an in-place implementation returned new tensors"
    return {**out, "ok": error is None, "error": error}


def activation_indices(op) -> list[int]:
    """The positions of the op's activations (``x``, ``x_residual``, ...)."""
    found = getattr(op, "activation_indices", None)
    if found is not None:
        return list(found)
    params = inspect.signature(op.impls[NATIVE].impl_fn).parameters
    return [i for i, name in enumerate(params) if name.startswith("x")]


def _weight_index(op) -> int | None:
    params = list(inspect.signature(op.impls[NATIVE].impl_fn).parameters)
    return params.index("weight") if "weight" in params else None


def op_inputs(op, shape, dtype, *, weighted: bool = True, seed: int = 0) -> tuple:
    """The op's own generated inputs for ``shape`` (leading dims flattened into
    tokens, then restored on the activations); ``weighted=False``: no weight."""
    import torch

    torch.manual_seed(seed)
    tokens = 1
    for d in shape[:-1]:
        tokens *= d
    args = list(
        op.generate_inputs(num_tokens=tokens, hidden_size=shape[-1], dtype=dtype)
    )
    for i in activation_indices(op):
        args[i] = args[i].reshape(shape)
    w = _weight_index(op)
    if not weighted and w is not None:
        args[w] = None
    return tuple(args)


def expected_of(op, args: Sequence[Any]) -> tuple:
    """Native's outputs on a copy of ``args``."""
    return as_tuple(op.impls[NATIVE].impl_fn(*copy_args(args)))


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
    _explain_truncation(op, impl, cases)
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


def _explain_truncation(op, impl, cases: list[dict]) -> None:
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


# --- per x86 kernel build: the CPU kernels themselves against native ----------

BUILD_DTYPES = ("bfloat16", "float16", "float32")
BUILD_SHAPES = ((1, 2048), (512, 2048), (2048, 4096))
"""(tokens, hidden size): among vLLM's own IR norm test sizes."""


def needed_rtol(actual, expected, atol: float) -> float:
    """The smallest ``rtol`` with which ``torch.testing.assert_close(actual,
    expected, atol=atol, rtol=...)`` passes (``inf``: none does)."""
    import torch

    a, e = actual.double(), expected.double()
    excess = ((a - e).abs() - atol).clamp(min=0)
    if not bool((excess > 0).any()):
        return 0.0
    if bool(((e == 0) & (excess > 0)).any()):
        return float("inf")
    return float((excess / e.abs().clamp(min=torch.finfo(torch.float64).tiny)).max())


def kernel_call(name: str):
    """The CPU kernel as a function of the op's inputs, returning its outputs."""
    import torch

    if name == "rms_norm":

        def call(x, weight, eps):
            out = torch.empty_like(x)
            torch.ops._C.rms_norm(out, x, weight, eps)
            return out

        return call

    def call_fused(x, residual, weight, eps):
        torch.ops._C.fused_add_rms_norm(x, residual, weight, eps)  # in place
        return x, residual

    return call_fused


def build_numerics(library: str) -> dict:
    """In a child: load ``library``'s kernel build (``runtime.cpu_library``) and
    hold its two norm kernels to vLLM's native implementation on vLLM's own
    generated inputs: per op and dtype, the largest rtol any shape needs."""
    import torch

    from vllm_patch.runtime import cpu_library

    cpu_library.force(library)
    from vllm import ir
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    loaded = cpu_library.loaded()
    found: dict[tuple[str, str], dict] = {}
    for name in OPS:
        op = getattr(ir.ops, name)
        for dtype_name in BUILD_DTYPES:
            dtype = getattr(torch, dtype_name)
            tol = op.get_tolerance(dtype)
            case = found.setdefault(
                (name, dtype_name),
                {"op": name, "dtype": dtype_name, "needed_rtol": 0.0, **tol},
            )
            for tokens, hidden in BUILD_SHAPES:
                args = op_inputs(op, (tokens, hidden), dtype)
                try:
                    got = as_tuple(kernel_call(name)(*copy_args(args)))
                except RuntimeError as exc:  # a dtype the build lacks
                    case["error"] = str(exc).splitlines()[0]
                    break
                for a, e in zip(got, expected_of(op, args), strict=True):
                    need = needed_rtol(a, e, tol["atol"])
                    case["needed_rtol"] = max(case["needed_rtol"], need)
    return {"loaded": loaded, "cases": list(found.values())}


def per_build(progress) -> tuple[dict, dict]:
    """:func:`build_numerics` for every kernel build this CPU runs, each in its
    own child (a process loads one build): per build, op and dtype the rtol
    needed against native (on ``BUILD_SHAPES``), and per op and dtype vLLM's
    own [rtol, atol]."""
    from vllm_patch.runtime import child, cpu_library, machine

    builds, tolerance = {}, {}
    for cpu_class in cpu_library.runnable(machine.cpu()["flags"]):
        name = cpu_library.LIBRARIES[cpu_class]
        progress(f"numerics: the {name} build")
        outcome = child.run(
            "vllm_patch.bench.numerics:build_numerics",
            {"library": cpu_class},
            timeout=900,
        )
        result = outcome.value()
        if name not in result["loaded"]:
            raise RuntimeError(f"asked for {name}, vLLM loaded {result['loaded']}")
        for c in result["cases"]:
            need = c.get("error") or c["needed_rtol"]
            builds.setdefault(name, {}).setdefault(c["op"], {})[c["dtype"]] = need
            tolerance.setdefault(c["op"], {})[c["dtype"]] = [c["rtol"], c["atol"]]
    return builds, tolerance
