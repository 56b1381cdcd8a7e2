"""Create vLLM's test of ``RMSNorm.forward_cpu``: ``tests/kernels/core/
test_cpu_layernorm.py``, beside ``test_cpu_activation.py`` (the tests of the
other CPU kernels a ``forward_cpu`` calls) and ``test_layernorm.py``.

The file (``SOURCE``, laid out as vLLM's ruff lays it out), through vLLM's own
dispatch (``rms_norm`` enabled, as in an eager engine), compares the layer with
``forward_native`` at ``test_layernorm.py``'s tolerance; and exactly with the
kernel where the kernel applies, and with ``forward_native`` where it must not
(strided inputs, hidden sizes that are not a multiple of 8, a weightless norm, a
variance size override, batch invariance).
"""

from __future__ import annotations

import libcst as cst

from patcher.codemod import TreeCodemod

SOURCE = '''\
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project

import pytest
import torch

from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
from vllm.platforms import current_platform
from vllm.utils.torch_utils import set_random_seed

if not current_platform.is_cpu():
    pytest.skip("skipping CPU-only tests", allow_module_level=True)

from vllm.model_executor.layers.layernorm import RMSNorm

DTYPES = [torch.half, torch.bfloat16, torch.float]
NUM_TOKENS = [7, 83, 4096]  # Arbitrary values for testing
HIDDEN_SIZES = [8, 768, 769, 5120, 5125, 8192]  # Arbitrary values for testing
ADD_RESIDUAL = [False, True]
SEEDS = [0]


@pytest.fixture
def rms_norm_enabled():
    """The rms_norm custom op enabled, as in an eager CPU engine."""
    config = VllmConfig(compilation_config=CompilationConfig(custom_ops=["+rms_norm"]))
    with set_current_vllm_config(config):
        yield config


def _inputs(num_tokens, hidden_size, add_residual, dtype, strided_input):
    scale = 1 / (2 * hidden_size)
    last_dim = 2 * hidden_size if strided_input else hidden_size
    x = torch.randn(num_tokens, last_dim, dtype=dtype)
    x = x[..., :hidden_size]
    assert x.is_contiguous() != strided_input
    x *= scale
    residual = x.new_empty_strided(x.size(), x.stride()) if add_residual else None
    if residual is not None:
        residual.normal_(std=scale)
    return x, residual


def _clone(x, residual):
    return x.clone(), None if residual is None else residual.clone()


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("hidden_size", HIDDEN_SIZES)
@pytest.mark.parametrize("add_residual", ADD_RESIDUAL)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("strided_input", [False, True])
@torch.inference_mode()
def test_cpu_rms_norm(
    rms_norm_enabled,
    num_tokens: int,
    hidden_size: int,
    add_residual: bool,
    dtype: torch.dtype,
    seed: int,
    strided_input: bool,
) -> None:
    set_random_seed(seed)
    layer = RMSNorm(hidden_size).to(dtype=dtype)
    layer.weight.data.normal_(mean=1.0, std=0.1)
    x, residual = _inputs(num_tokens, hidden_size, add_residual, dtype, strided_input)

    # The reference goes first: the fused kernel is in place.
    ref_out = layer.forward_native(*_clone(x, residual))
    kernel_args = _clone(x, residual)
    out = layer(x, residual)
    # NOTE(woosuk): LayerNorm operators (including RMS) typically have larger
    # numerical errors than other operators because they involve reductions.
    # Therefore, we use a larger tolerance.
    if add_residual:
        torch.testing.assert_close(out[0], ref_out[0], atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(out[1], ref_out[1], atol=1e-2, rtol=1e-2)
    else:
        torch.testing.assert_close(out, ref_out, atol=1e-2, rtol=1e-2)

    # Contiguous inputs in whole vectors of 8 go to the kernel, bit for bit;
    # the rest to forward_native, and so does the fused add in bfloat16 where
    # the kernels truncate (no AVX512-BF16).
    truncates = dtype == torch.bfloat16 and not torch.cpu._is_avx512_bf16_supported()
    if strided_input or hidden_size % 8 != 0 or (add_residual and truncates):
        expected = ref_out
    elif add_residual:
        torch.ops._C.fused_add_rms_norm(
            *kernel_args, layer.weight.data, layer.variance_epsilon
        )
        expected = kernel_args
    else:
        expected = torch.empty_like(x)
        torch.ops._C.rms_norm(
            expected, kernel_args[0], layer.weight.data, layer.variance_epsilon
        )
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "batch_invariant"),
    [({"has_weight": False}, "0"), ({"var_hidden_size": 64}, "0"), ({}, "1")],
)
@pytest.mark.parametrize("add_residual", ADD_RESIDUAL)
@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_cpu_rms_norm_native_semantics(
    rms_norm_enabled,
    monkeypatch: pytest.MonkeyPatch,
    kwargs: dict,
    batch_invariant: str,
    add_residual: bool,
    dtype: torch.dtype,
) -> None:
    """A weightless norm, a variance size override and batch invariance keep
    the native path, bit for bit."""
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", batch_invariant)
    set_random_seed(0)
    layer = RMSNorm(768, **kwargs).to(dtype=dtype)
    x, residual = _inputs(3, 768, add_residual, dtype, strided_input=False)
    x, residual = x[None], None if residual is None else residual[None]

    ref_out = layer.forward_native(*_clone(x, residual))
    out = layer(x, residual)
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
'''


class AddCpuLayerNormTests(TreeCodemod):
    DESCRIPTION = (
        "Add tests/kernels/core/test_cpu_layernorm.py: RMSNorm's CPU kernels "
        "against forward_native, and the inputs that must stay native."
    )

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        if tree.code == SOURCE:
            return tree
        if tree.code.strip():
            raise self.shape_error(
                "no file, or the file this patch writes", "another file"
            )
        self.record(f"`{self.TARGET}` is added")
        return cst.parse_module(SOURCE)


class RemoveCpuLayerNormTests(TreeCodemod):
    DESCRIPTION = "Undo AddCpuLayerNormTests: the test file goes."

    def transform_module_impl(self, tree: cst.Module) -> cst.Module:
        if not tree.code.strip():
            return tree
        if tree.code != SOURCE:
            raise self.shape_error("the file this patch writes", "another file")
        self.record(f"`{self.TARGET}` is removed")
        return cst.Module(body=[])
