"""vllm_patch.bench.numerics, the one comparison of an implementation against native,
on the real vLLM: right and wrong implementations, and the kernels called
directly (the fused add writes into its inputs)."""

from __future__ import annotations

import pytest
from conftest import requires_vllm

# Without torch (the fast tier) this module is skipped.
pytest.importorskip("torch")

from vllm_patch.bench import numerics

pytestmark = requires_vllm


@pytest.fixture(scope="module")
def ops():
    """vLLM IR ops, vLLM's kernels loaded."""
    import vllm._custom_ops  # noqa: F401
    import vllm.kernels  # noqa: F401
    from vllm import ir

    return ir.ops


def test_copies_keep_the_layout_of_a_strided_view():
    import torch

    wide = torch.arange(32.0).reshape(4, 8)
    view = wide[:, 4:]  # a row-strided view, as a split of a fused projection
    (copy, eps) = numerics.copy_args((view, 1e-6))
    assert copy.stride() == view.stride() and not copy.is_contiguous()
    assert torch.equal(copy, view) and copy.data_ptr() != view.data_ptr()
    assert eps == 1e-6


def test_a_right_implementation_passes_and_one_that_is_off_fails(ops):
    import torch

    op = ops.rms_norm
    args = numerics.op_inputs(op, 16, 2048, torch.bfloat16)
    expected = numerics.expected_of(op, args)
    tolerance = op.get_tolerance(torch.bfloat16)
    native = op.impls["native"].impl_fn

    assert numerics.mismatch(native, args, expected, tolerance) is None
    off = numerics.mismatch(lambda *a: native(*a) * 1.25, args, expected, tolerance)
    assert off.startswith("outside tolerance")
    raised = numerics.mismatch(lambda *a: 1 / 0, args, expected, tolerance)
    assert raised == "raised ZeroDivisionError: division by zero"


def test_the_kernels_pass_on_the_ops_own_inputs_and_write_in_place(ops):
    """vLLM's own fused add kernel: right, and its outputs are its inputs."""
    import torch

    op = ops.fused_add_rms_norm
    args = numerics.op_inputs(op, 16, 2048, torch.bfloat16)
    call = numerics.kernel_call("fused_add_rms_norm")
    expected = numerics.expected_of(op, args)
    tolerance = op.get_tolerance(torch.bfloat16)
    assert numerics.mismatch(call, args, expected, tolerance) is None
    x, residual = call(*args)
    assert x.data_ptr() == args[0].data_ptr()
    assert residual.data_ptr() == args[1].data_ptr()
    assert numerics.mismatch(
        lambda *a: call(*a)[:1], args, expected, tolerance
    ) == ("1 output tensors, native gives 2")
