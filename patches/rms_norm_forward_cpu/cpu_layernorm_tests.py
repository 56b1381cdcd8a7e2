"""vLLM's test that ``RMSNorm.forward_cpu`` matches native, beside its CPU tests."""

import libcst as cst

from patcher.codemod import TreeCodemod

SOURCE = '''\
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project

import pytest
import torch
from torch.profiler import profile

from vllm.platforms import current_platform
from vllm.utils.torch_utils import set_random_seed

if not current_platform.is_cpu():
    pytest.skip("skipping CPU-only tests", allow_module_level=True)

from vllm.model_executor.layers import layernorm
from vllm.model_executor.layers.layernorm import RMSNorm

KERNELS = ("_C::rms_norm", "_C::fused_add_rms_norm")
# Against forward_native: test_layernorm.py's 1e-2 for 16-bit dtypes.
TOLERANCES = {
    torch.float: {"atol": 1e-5, "rtol": 1e-5},
    torch.half: {"atol": 1e-2, "rtol": 1e-2},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
}


@pytest.fixture
def rms_norm_enabled(default_vllm_config):
    default_vllm_config.compilation_config.custom_ops = ["none", "+rms_norm"]
    # The kernels run with an OpenMP team that leaves a core to spare.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rms_norm(shape, dtype, residual_dtype=None, strided=False):
    """The layer's output, forward_native's, the layer, and the kernel calls."""
    set_random_seed(0)
    hidden_size = shape[-1]
    layer = RMSNorm(hidden_size).to(dtype=dtype)
    layer.weight.data.normal_(mean=1.0, std=0.1)
    wide = (*shape[:-1], 2 * hidden_size) if strided else shape
    x = torch.randn(wide, dtype=dtype)[..., :hidden_size]
    residual = None
    if residual_dtype is not None:
        residual = torch.randn(shape, dtype=residual_dtype)
    ref = layer.forward_native(
        x.clone(), None if residual is None else residual.clone()
    )
    with profile() as prof:
        out = layer(x, residual)
    calls = sum(e.count for e in prof.key_averages() if e.key in KERNELS)
    return out, ref, layer, calls


@pytest.mark.parametrize(
    ("shape", "dtype", "residual_dtype"),
    [
        ((7, 768), torch.float, None),
        ((7, 768), torch.float, torch.float),
        ((7, 4096), torch.half, None),
        ((7, 4096), torch.half, torch.half),
        ((7, 4096), torch.bfloat16, None),
        ((7, 4096), torch.bfloat16, torch.bfloat16),
        ((1, 16, 128), torch.float, None),
        ((1, 16, 128), torch.bfloat16, None),
    ],
)
@torch.inference_mode()
def test_cpu_rms_norm_kernel(rms_norm_enabled, shape, dtype, residual_dtype):
    out, ref, layer, calls = _rms_norm(shape, dtype, residual_dtype)
    # The rule the layer applies: the dtypes in which this build matches native.
    expected = dtype in layernorm.cpu_norm_dtypes()
    assert layer.cpu_dtypes == layernorm.cpu_norm_dtypes()
    assert calls == expected
    if residual_dtype is None:
        torch.testing.assert_close(out, ref, **TOLERANCES[dtype])
    else:
        for got, want in zip(out, ref):
            torch.testing.assert_close(got, want, **TOLERANCES[dtype])


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
def test_cpu_rms_norm_native_fallback(rms_norm_enabled, shape, strided, residual_dtype):
    out, ref, _, calls = _rms_norm(shape, torch.float, residual_dtype, strided)
    assert calls == 0
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
'''


class AddCpuLayerNormTests(TreeCodemod):
    DESCRIPTION = "Add vLLM's test of RMSNorm.forward_cpu beside its CPU kernel tests."
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
