"""vLLM's test that ``RMSNorm.forward_cpu`` matches native, beside its CPU tests."""

import libcst as cst

from patcher.codemod import TreeCodemod

SOURCE = '''\
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project

import functools

import pytest
import torch
from torch.profiler import profile

from vllm import _custom_ops as ops
from vllm.platforms import CpuArchEnum, current_platform
from vllm.utils.torch_utils import set_random_seed

if not current_platform.is_cpu():
    pytest.skip("skipping CPU-only tests", allow_module_level=True)

from vllm.model_executor.layers.layernorm import RMSNorm

DTYPES = [torch.float, torch.half, torch.bfloat16]
# Decode and prefill rows, and a one-token [tokens, heads, head_dim] q/k norm.
SHAPES = [(1, 4096), (83, 768), (1, 16, 128)]
KERNELS = ("_C::rms_norm", "_C::fused_add_rms_norm")
# Against forward_native: test_layernorm.py's 1e-2 for 16-bit dtypes.
TOLERANCES = {
    torch.float: {"atol": 1e-5, "rtol": 1e-5},
    torch.half: {"atol": 1e-2, "rtol": 1e-2},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
}
# Large enough to resolve a bias of a fraction of a unit roundoff.
BIAS_SHAPE = (512, 2048)


@pytest.fixture
def rms_norm_enabled(default_vllm_config):
    default_vllm_config.compilation_config.custom_ops = ["none", "+rms_norm"]
    # The kernels run with an OpenMP team that leaves a core to spare.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _inputs(shape, dtype, residual_dtype=None, strided=False):
    """Returns an RMSNorm with a random weight, its input and its residual."""
    set_random_seed(0)
    hidden_size = shape[-1]
    layer = RMSNorm(hidden_size).to(dtype=dtype)
    layer.weight.data.normal_(mean=1.0, std=0.1)
    wide = (*shape[:-1], 2 * hidden_size) if strided else shape
    x = torch.randn(wide, dtype=dtype)[..., :hidden_size]
    residual = None
    if residual_dtype is not None:
        residual = torch.randn(shape, dtype=residual_dtype)
    return layer, x, residual


def _copies(x, residual):
    # The kernels and forward_native may write into their inputs. A copy of a
    # strided view is contiguous: the layer itself gets the inputs, last.
    return x.clone(), None if residual is None else residual.clone()


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


def _kernel(layer, x, residual):
    """Returns the CPU kernel's output on copies of the inputs."""
    x, residual = _copies(x, residual)
    weight = layer.weight.data
    if residual is None:
        out = torch.empty_like(x)
        ops.rms_norm(out, x, weight, layer.variance_epsilon)
        return out
    ops.fused_add_rms_norm(x, residual, weight, layer.variance_epsilon)
    return x, residual


def _reference(layer, x, residual):
    """Returns RMSNorm in float64 and, with a residual, the exact sum."""
    h = x.double() if residual is None else x.double() + residual.double()
    variance = h.pow(2).mean(-1, keepdim=True)
    out = h * torch.rsqrt(variance + layer.variance_epsilon) * layer.weight.double()
    return out if residual is None else (out, h)


def _bias(out, ref):
    """Returns the mean signed relative error of out, weighted by |ref|.

    Negative is toward zero, as a truncation to a shorter mantissa.
    """
    return float(((out.double() - ref) * ref.sign()).sum() / ref.abs().sum())


def _bias_margin(dtype):
    # A quarter of the dtype's unit roundoff: where the kernel rounds to the
    # dtype as torch does, its bias is native's within 0.02 of it; where it
    # truncates float32 to bfloat16 (_C_AVX2, _C_AVX512), 0.5 to 1.2 off. Plus
    # 4 float32 roundoffs: both sum in float32, in a different order.
    unit_roundoff = torch.finfo(dtype).eps / 2
    return unit_roundoff / 4 + 4 * torch.finfo(torch.float).eps / 2


@functools.cache
def _kernel_matches_native(dtype, add_residual):
    """Returns whether this build's kernel matches forward_native in dtype.

    Measured, independent of the layer: the kernel runs, its outputs are within
    TOLERANCES of forward_native's and their bias against float64 is no larger
    than forward_native's plus the margin.

    Args:
        dtype: The input, residual and weight dtype.
        add_residual: Whether the fused add (fused_add_rms_norm) is measured.

    """
    if (
        dtype == torch.bfloat16
        and current_platform.get_cpu_architecture() == CpuArchEnum.ARM
        and not torch.cpu.get_capabilities().get("bf16", False)
    ):
        # The aarch64 build's bfloat16 kernels need BF16: SIGILL without it.
        return False
    layer, x, residual = _inputs(BIAS_SHAPE, dtype, dtype if add_residual else None)
    try:
        got = _kernel(layer, x, residual)
    except RuntimeError:  # no kernel for this dtype in this build
        return False
    want = layer.forward_native(*_copies(x, residual))
    ref = _reference(layer, x, residual)
    return all(
        torch.allclose(g, w, **TOLERANCES[dtype])
        and abs(_bias(g, r)) <= abs(_bias(w, r)) + _bias_margin(dtype)
        for g, w, r in zip(_outputs(got), _outputs(want), _outputs(ref))
    )


def _run(layer, x, residual):
    """Returns the layer's output and its number of kernel calls."""
    with profile() as prof:
        out = layer(x, residual)
    calls = sum(e.count for e in prof.key_averages() if e.key in KERNELS)
    return out, calls


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("add_residual", [False, True], ids=["norm", "fused-add"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@torch.inference_mode()
def test_cpu_rms_norm_kernel(
    rms_norm_enabled,
    shape: tuple[int, ...],
    add_residual: bool,
    dtype: torch.dtype,
) -> None:
    """Contiguous inputs run the CPU kernel exactly where it matches forward_native."""
    matches = _kernel_matches_native(dtype, add_residual)
    layer, x, residual = _inputs(shape, dtype, dtype if add_residual else None)
    ref_out = layer.forward_native(*_copies(x, residual))
    expected = _kernel(layer, x, residual) if matches else ref_out
    out, calls = _run(layer, x, residual)
    path = "the CPU kernel" if matches else "forward_native"
    for got, want, ref in zip(_outputs(out), _outputs(expected), _outputs(ref_out)):
        torch.testing.assert_close(
            got, want, atol=0, rtol=0, msg=lambda m: f"not {path}'s output: {m}"
        )
        torch.testing.assert_close(got, ref, **TOLERANCES[dtype])
    assert calls == (1 if matches else 0), f"{calls} kernel calls; {path} matches"


@pytest.mark.parametrize(
    ("shape", "strided", "residual_dtype"),
    [
        ((7, 769), False, None),
        ((7, 769), False, torch.float),
        ((7, 768), True, None),
        ((7, 768), True, torch.float),
        ((1, 16, 128), True, None),
        ((7, 768), False, torch.half),
    ],
    ids=[
        "hidden-769",
        "hidden-769-residual",
        "strided",
        "strided-residual",
        "strided-per-head",
        "residual-half",
    ],
)
@torch.inference_mode()
def test_cpu_rms_norm_native_fallback(
    rms_norm_enabled,
    shape: tuple[int, ...],
    strided: bool,
    residual_dtype: torch.dtype | None,
) -> None:
    """Inputs the kernels do not take run forward_native, bit for bit."""
    layer, x, residual = _inputs(shape, torch.float, residual_dtype, strided)
    ref_out = layer.forward_native(*_copies(x, residual))
    out, calls = _run(layer, x, residual)
    for got, ref in zip(_outputs(out), _outputs(ref_out)):
        torch.testing.assert_close(got, ref, atol=0, rtol=0)
    assert calls == 0
'''


class AddCpuLayerNormTests(TreeCodemod):
    DESCRIPTION = (
        "Add vLLM's test of RMSNorm.forward_cpu beside its CPU kernel tests."
    )
    ON = True  # the change; RemoveCpuLayerNormTests's False: its inverse

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        if tree.code.strip() and tree.code != SOURCE:
            raise self.shape_error(
                "no file, or the file this patch writes", "another file"
            )
        if (tree.code == SOURCE) == self.ON:  # there already, or gone already
            return tree
        self.record(f"`{self.TARGET}` is {'added' if self.ON else 'removed'}")
        return cst.parse_module(SOURCE if self.ON else "")


class RemoveCpuLayerNormTests(AddCpuLayerNormTests):
    DESCRIPTION = "Undo AddCpuLayerNormTests: the test file goes."
    ON = False
