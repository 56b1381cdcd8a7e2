"""An IR implementation against the op's ``native`` one on the op's own inputs
(:func:`compare`, the one comparison), and each x86 build's kernels against
native (:func:`per_build`)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

from patches.cpu_fused_norms.identity import OPS
from vllm_patch.runtime.bench_result import NATIVE


def copy_args(args: Sequence[Any]) -> tuple:
    """Each tensor copied with its strides (a strided view stays one), the rest
    as is: an implementation may write into its inputs."""
    import torch

    return tuple(
        a.new_empty_strided(a.shape, a.stride()).copy_(a)
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
    """``fn`` on a copy of ``args``, its output tensors held to native's
    ``expected``: ``ok``, ``max_abs_diff``, ``max_abs_err``, ``error``.
    ``inplace``: the argument indices whose tensors the outputs must be."""
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
            wrong = f"output {a.dtype}{list(a.shape)} != {e.dtype}{list(e.shape)}"
            error = error or wrong
            continue
        diff = (a.float() - e.float()).abs()
        out["max_abs_diff"].append(float(diff.max()) if diff.numel() else 0.0)
        try:
            torch.testing.assert_close(a, e, **tolerance)
        except AssertionError as exc:
            first = str(exc).strip().splitlines()[0]
            error = error or f"outside tolerance {tolerance}: {first}"
    out["max_abs_err"] = max(out["max_abs_diff"], default=None)
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


def op_inputs(op, shape, dtype) -> tuple:
    """The op's own generated inputs for ``shape`` (leading dims flattened into
    tokens, restored on the activations), seeded."""
    import torch

    torch.manual_seed(0)
    tokens = math.prod(shape[:-1])
    args = list(
        op.generate_inputs(num_tokens=tokens, hidden_size=shape[-1], dtype=dtype)
    )
    for i in activation_indices(op):
        args[i] = args[i].reshape(shape)
    return tuple(args)


def expected_of(op, args: Sequence[Any]) -> tuple:
    """Native's outputs on a copy of ``args``."""
    return as_tuple(op.impls[NATIVE].impl_fn(*copy_args(args)))


BUILD_DTYPES = ("bfloat16", "float16", "float32")
BUILD_SHAPES = ((1, 2048), (512, 2048), (2048, 4096))  # among vLLM's test sizes


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

    kernel = getattr(torch.ops._C, name)

    def call(x, *rest):  # rest: [residual,] weight, eps
        if name == "rms_norm":
            out = torch.empty_like(x)
            kernel(out, x, *rest)
            return out
        kernel(x, *rest)  # in place
        return x, rest[0]

    return call


def build_numerics(library: str) -> dict:
    """In a child: load ``library``'s kernel build (``runtime.cpu_library``);
    per op and dtype, the largest rtol its kernel needs against native."""
    import torch

    from vllm_patch.runtime import cpu_library

    cpu_library.force(library)
    from vllm import ir
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    loaded = cpu_library.loaded()
    cases = []
    for name in OPS:
        op = getattr(ir.ops, name)
        for dtype_name in BUILD_DTYPES:
            dtype = getattr(torch, dtype_name)
            tol = op.get_tolerance(dtype)
            case = {"op": name, "dtype": dtype_name, "needed_rtol": 0.0, **tol}
            cases.append(case)
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
    return {"loaded": loaded, "cases": cases}


def per_build(progress) -> tuple[dict, dict]:
    """:func:`build_numerics` per build this CPU runs, a child each: per build,
    op and dtype the rtol needed; per op and dtype vLLM's [rtol, atol]."""
    from vllm_patch.runtime import child, cpu_library, machine

    builds, tolerance = {}, {}
    for cpu_class in cpu_library.runnable(machine.cpu()["flags"]):
        name = cpu_library.LIBRARIES[cpu_class]
        progress(f"numerics: the {name} build")
        asked = {"library": cpu_class}
        result = child.run(f"{__name__}:build_numerics", asked, timeout=900).value()
        if name not in result["loaded"]:
            raise RuntimeError(f"asked for {name}, vLLM loaded {result['loaded']}")
        for c in result["cases"]:
            need = c.get("error") or c["needed_rtol"]
            builds.setdefault(name, {}).setdefault(c["op"], {})[c["dtype"]] = need
            tolerance.setdefault(c["op"], {})[c["dtype"]] = [c["rtol"], c["atol"]]
    return builds, tolerance
