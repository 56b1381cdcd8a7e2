"""vllm_patch.bench.numerics, the one comparison of an IR implementation against native,
on the real vLLM: right and wrong implementations, in-place ones, and
strided inputs through IR dispatch."""

from __future__ import annotations

import pytest
from conftest import requires_vllm

# The provider imports torch: without it (the fast tier) this module is skipped.
pytest.importorskip("torch")
import numerics_grid as grid

from patches.cpu_fused_norms import provider
from vllm_patch.bench import numerics

pytestmark = requires_vllm


@pytest.fixture(scope="module")
def ops():
    """vLLM IR ops with the provider registered (as the plugin does)."""
    from vllm import ir

    provider.register()
    if not all(provider.status()["supported"].values()):
        pytest.skip(f"kernels unsupported: {provider.status()['unsupported_reasons']}")
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
    impl = op.impls[provider.PROVIDER]
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


def test_the_provider_passes_the_grid_of_dtypes_and_shapes(ops):
    for name in provider.OPS:
        cases = grid.compare_impl(getattr(ops, name), provider.PROVIDER)
        assert len(cases) == len(grid.DTYPE_NAMES) * (len(grid.SHAPES) + 1)
        assert [c for c in cases if not c["ok"]] == []
        assert {c["weight"] for c in cases} == {True, False}


def test_strided_inputs_go_to_native_and_stay_right(ops):
    for name in provider.OPS:
        found = grid.noncontiguous_dispatch(getattr(ops, name), provider.PROVIDER)
        assert found["ok"], found
        assert found["contiguous"] == provider.PROVIDER
        for layout in ("transposed", "row_strided"):
            assert found[layout]["dispatched_to"] == "native"
            assert found[layout]["right"]


def _drop_low_bits(t):
    """float32 -> bfloat16 by truncation, as vLLM's AVX2 CPU kernels convert."""
    import torch

    return (t.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


class _Impl:
    def __init__(self, fn):
        self.impl_fn = fn


def _native_then(convert):
    """rms_norm computed in float32 by native, converted back by ``convert``."""
    import torch
    from vllm import ir

    native = ir.ops.rms_norm.impls["native"].impl_fn

    def impl(x, weight, epsilon, variance_size=None):
        w = None if weight is None else weight.float()
        out = native(x.float(), w, epsilon, variance_size)
        return convert(out) if x.dtype == torch.bfloat16 else out.to(x.dtype)

    return impl


@pytest.mark.parametrize(
    ("convert", "truncates"),
    [
        (_drop_low_bits, True),
        (lambda t: t.to(__import__("torch").bfloat16), False),  # torch rounds
    ],
)
def test_a_kernel_that_truncates_to_bfloat16_is_told_from_one_that_rounds(
    ops, convert, truncates
):
    import torch

    args = numerics.op_inputs(ops.rms_norm, (16, 4096), torch.bfloat16)
    share = grid.truncated_share(_native_then(convert), args)
    assert (share > grid.TRUNCATION_SHARE) is truncates, share


def _grid(ok_fp32: bool, ok_bf16: bool) -> list[dict]:
    return [
        {"dtype": d, "shape": [16, 4096], "weight": True, "ok": ok, "max_abs_diff": [1]}
        for d, ok in (("float32", ok_fp32), ("bfloat16", ok_bf16))
    ]


@pytest.mark.parametrize(
    ("convert", "ok_fp32", "explained"),
    [
        (_drop_low_bits, True, True),  # off only by the truncation: reported
        (_drop_low_bits, False, False),  # wrong in float32 too: still a failure
        (lambda t: (t * 1.25).to(__import__("torch").bfloat16), True, False),
    ],
)
def test_only_a_bfloat16_miss_that_is_all_truncation_is_explained(
    ops, convert, ok_fp32, explained
):
    cases = _grid(ok_fp32=ok_fp32, ok_bf16=False)
    grid.explain_truncation(ops.rms_norm, _Impl(_native_then(convert)), cases)
    bf16 = cases[1]
    assert bf16["ok"] is explained
    assert ("truncates_bf16" in bf16) is explained


# (actual, expected, atol) -> the smallest rtol with which assert_close passes
NEEDED_RTOL = {
    "equal": ([1.0, 2.0], [1.0, 2.0], 0.0, 0.0),
    "within atol": ([1.05, 2.0], [1.0, 2.0], 0.1, 0.0),
    "beyond atol, relative to expected": ([1.3, 2.0], [1.0, 2.0], 0.1, 0.2),
    "the worst element counts": ([1.1, 2.8], [1.0, 2.0], 0.0, 0.4),
    "off where expected is zero": ([0.5], [0.0], 0.1, float("inf")),
}


@pytest.mark.parametrize("case", NEEDED_RTOL.values(), ids=NEEDED_RTOL.keys())
def test_the_rtol_a_kernel_needs_is_what_assert_close_accepts(case):
    import torch

    actual, expected, atol, rtol = case
    a, e = torch.tensor(actual), torch.tensor(expected)
    need = numerics.needed_rtol(a, e, atol)
    assert need == pytest.approx(rtol)
    if need != float("inf"):
        torch.testing.assert_close(a, e, atol=atol, rtol=need * 1.0001 + 1e-12)
        if need:
            with pytest.raises(AssertionError):
                torch.testing.assert_close(a, e, atol=atol, rtol=need * 0.99)
