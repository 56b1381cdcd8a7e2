"""vLLM's test that ``RMSNorm.forward_cpu`` matches native, beside its CPU tests."""

import libcst as cst

from patcher.codemod import TreeCodemod

SOURCE = '''\
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project

import pytest
import torch
from torch.profiler import profile

from vllm import ir
from vllm.platforms import current_platform
from vllm.utils.torch_utils import set_random_seed

if not current_platform.is_cpu():
    pytest.skip("skipping CPU-only tests", allow_module_level=True)

from vllm.model_executor.layers.layernorm import RMSNorm

KERNELS = ("_C::rms_norm", "_C::fused_add_rms_norm")


@pytest.fixture
def rms_norm_enabled(default_vllm_config):
    default_vllm_config.compilation_config.custom_ops = ["none", "+rms_norm"]


def _rms_norm(hidden_size, dtype, residual_dtype=None, strided=False):
    """The layer's output, forward_native's, and the kernel calls made."""
    set_random_seed(0)
    layer = RMSNorm(hidden_size).to(dtype=dtype)
    layer.weight.data.normal_(mean=1.0, std=0.1)
    last_dim = 2 * hidden_size if strided else hidden_size
    x = torch.randn(7, last_dim, dtype=dtype)[..., :hidden_size]
    residual = None
    if residual_dtype is not None:
        residual = torch.randn_like(x).to(residual_dtype)
    ref = layer.forward_native(
        x.clone(), None if residual is None else residual.clone()
    )
    with profile() as prof:
        out = layer(x, residual)
    calls = sum(e.count for e in prof.key_averages() if e.key in KERNELS)
    return out, ref, calls


@pytest.mark.parametrize(
    ("dtype", "residual_dtype"),
    [
        (torch.float, None),
        (torch.float, torch.float),
        (torch.half, None),
        (torch.half, torch.half),
        (torch.bfloat16, None),
    ],
)
@pytest.mark.parametrize("hidden_size", [768, 4096])
@torch.inference_mode()
def test_cpu_rms_norm_kernel(rms_norm_enabled, hidden_size, dtype, residual_dtype):
    out, ref, calls = _rms_norm(hidden_size, dtype, residual_dtype)
    assert calls == 1
    op = ir.ops.rms_norm if residual_dtype is None else ir.ops.fused_add_rms_norm
    torch.testing.assert_close(out, ref, **op.get_tolerance(dtype))


@pytest.mark.parametrize(
    ("hidden_size", "strided", "residual_dtype"),
    [
        (769, False, None),
        (769, False, torch.float),
        (768, True, None),
        (768, True, torch.float),
        (768, False, torch.half),
    ],
    ids=[
        "hidden-769",
        "hidden-769-residual",
        "strided",
        "strided-residual",
        "residual-half",
    ],
)
@torch.inference_mode()
def test_cpu_rms_norm_native_fallback(
    rms_norm_enabled, hidden_size, strided, residual_dtype
):
    twin_residual = None if residual_dtype is None else torch.float
    assert _rms_norm(768, torch.float, twin_residual)[2] == 1
    out, ref, calls = _rms_norm(hidden_size, torch.float, residual_dtype, strided)
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
