"""vllm_patch.bench.numerics, the one comparison of an IR implementation against native,
on the real vLLM: right and wrong implementations, and in-place ones (vLLM's
own ``"vllm_c"`` fused add, its kernel called directly, as the subject)."""

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
    args = numerics.op_inputs(op, (16, 2048), torch.bfloat16)
    expected = numerics.expected_of(op, args)
    tolerance = op.get_tolerance(torch.bfloat16)
    native = op.impls["native"].impl_fn

    right = numerics.compare(native, args, expected, tolerance)
    assert right["ok"] and right["error"] is None and right["max_abs_err"] == 0.0

    off = numerics.compare(lambda *a: native(*a) * 1.25, args, expected, tolerance)
    assert not off["ok"] and off["error"].startswith("outside tolerance")
    assert off["max_abs_err"] > 0

    raised = numerics.compare(lambda *a: 1 / 0, args, expected, tolerance)
    assert raised["error"] == "raised ZeroDivisionError: division by zero"


def test_an_in_place_implementation_must_return_the_callers_tensors(ops):
    import torch

    op = ops.fused_add_rms_norm
    impl = op.impls["vllm_c"]
    assert impl.inplace
    args = numerics.op_inputs(op, (16, 2048), torch.bfloat16)
    expected = numerics.expected_of(op, args)
    tolerance = op.get_tolerance(torch.bfloat16)
    where = numerics.activation_indices(op)

    in_place = numerics.compare(impl.impl_fn, args, expected, tolerance, inplace=where)
    assert in_place["ok"], in_place["error"]
    assert in_place["inplace"] == {"outputs_are_inputs": True}

    def new_tensors(*a):
        return tuple(t.clone() for t in impl.impl_fn(*a))

    copied = numerics.compare(new_tensors, args, expected, tolerance, inplace=where)
    assert not copied["ok"] and copied["inplace"] == {"outputs_are_inputs": False}
