"""The kernels against ``native``: one comparison, and each x86 build's."""

from collections.abc import Callable, Sequence
from typing import Any

from patches.cpu_fused_norms.identity import OPS
from vllm_patch.bench.record import NATIVE, Tolerance, record, typed

BUILD_DTYPES = ("bfloat16", "float16", "float32")
BUILD_SHAPES = ((1, 2048), (512, 2048), (2048, 4096))  # among vLLM's test sizes


def copy_args(args: Sequence[Any]) -> tuple:
    """Each tensor copied with its strides (an implementation may write into it)."""
    import torch

    return tuple(
        a.new_empty_strided(a.shape, a.stride()).copy_(a)
        if isinstance(a, torch.Tensor)
        else a
        for a in args
    )


def tensors(result: Any) -> list:
    """An implementation's output tensors (it returns one, a tuple or a list)."""
    import torch

    found = result if isinstance(result, (tuple, list)) else (result,)
    return [t for t in found if isinstance(t, torch.Tensor)]


def op_inputs(op, tokens: int, hidden: int, dtype) -> tuple:
    """The op's own generated inputs, seeded."""
    import torch

    torch.manual_seed(0)
    return tuple(
        op.generate_inputs(num_tokens=tokens, hidden_size=hidden, dtype=dtype)
    )


def expected_of(op, args: Sequence[Any]) -> list:
    """Native's output tensors on a copy of ``args``."""
    return tensors(op.impls[NATIVE].impl_fn(*copy_args(args)))


def mismatch(
    fn: Callable, args: tuple, expected: list, tolerance: dict
) -> str | None:
    """How ``fn`` on a copy of ``args`` differs from native's ``expected``, if it
    does."""
    import torch

    try:
        got = tensors(fn(*copy_args(args)))
    except Exception as exc:
        return f"raised {type(exc).__name__}: {exc}"
    if len(got) != len(expected):
        return f"{len(got)} output tensors, native gives {len(expected)}"
    for a, e in zip(got, expected, strict=True):
        if a.shape != e.shape or a.dtype != e.dtype:
            return f"output {a.dtype}{list(a.shape)} != {e.dtype}{list(e.shape)}"
        try:
            torch.testing.assert_close(a, e, **tolerance)
        except AssertionError as exc:
            first = str(exc).strip().splitlines()[0]
            return f"outside tolerance {tolerance}: {first}"
    return None


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
    """In a child with ``library``'s kernels: the rtol each op and dtype needs."""
    import torch

    from vllm_patch.runtime import cpu_library

    cpu_library.force(library)
    from vllm import ir
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    needed = {}
    tolerance = {}
    for name in OPS:
        op = getattr(ir.ops, name)
        for dtype_name in BUILD_DTYPES:
            dtype = getattr(torch, dtype_name)
            tol = op.get_tolerance(dtype)
            need = 0.0
            tolerance.setdefault(name, {})[dtype_name] = [tol["rtol"], tol["atol"]]
            for shape in BUILD_SHAPES:
                args = op_inputs(op, *shape, dtype)
                try:
                    got = tensors(kernel_call(name)(*copy_args(args)))
                except RuntimeError as exc:  # a dtype the build lacks
                    need = str(exc).splitlines()[0]
                    break
                for a, e in zip(got, expected_of(op, args), strict=True):
                    # the smallest rtol assert_close with atol passes (inf: none)
                    excess = ((a.double() - e).abs() - tol["atol"]).clamp(min=0)
                    rtol = torch.where(excess > 0, excess / e.double().abs(), 0.0)
                    need = max(need, float(rtol.max()))
            needed.setdefault(name, {})[dtype_name] = need
    return {
        "loaded": cpu_library.loaded(),
        "needed": needed,
        "tolerance": tolerance,
    }


Needed = dict[str, dict[str, float | str]]  # per op and dtype: rtol, or why none
Tolerances = dict[str, dict[str, Tolerance]]  # vLLM's, per op and dtype


@record
class BuildNumerics:
    """What :func:`build_numerics` prints in its child, read back checked."""

    loaded: tuple[str, ...]
    needed: Needed
    tolerance: Tolerances


def per_build(progress) -> tuple[dict[str, Needed], Tolerances]:
    """:func:`build_numerics` per build here; vLLM's [rtol, atol] per op, dtype."""
    from vllm_patch.runtime import child, cpu_library, machine

    builds: dict[str, Needed] = {}
    tolerance: Tolerances = {}
    for cpu_class in cpu_library.runnable(machine.cpu()["flags"]):
        name = cpu_library.LIBRARIES[cpu_class]
        progress(f"numerics: the {name} build")
        asked = {"library": cpu_class}
        printed = child.run(
            f"{__name__}:build_numerics", asked, timeout=900
        ).value()
        result = typed(BuildNumerics, printed, f"the {name} build's numerics")
        if name not in result.loaded:
            raise RuntimeError(
                f"asked for {name}, vLLM loaded {list(result.loaded)}"
            )
        builds[name] = result.needed
        tolerance = result.tolerance
    return builds, tolerance
