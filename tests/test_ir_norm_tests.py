"""RunIrNormTestsOnCpu / StopIrNormTestsOnCpu: vLLM's IR norm tests, before and
after, on small sources and on real upstream test files of two shapes."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from libcst.codemod import CodemodTest

from patcher import engine
from patcher.codemod import run_codemod
from patcher.errors import ShapeNotRecognised
from patcher.status import PlanStatus
from patcher.tree import open_tree
from patches.cpu_fused_norms.ir_norm_tests import (
    BF16_TOLERANCE_SOURCE,
    FUSED_ADD_RMS_NORM,
    NOT_CPU,
    RMS_NORM,
    RunIrNormTestsOnCpu,
    StopIrNormTestsOnCpu,
)
from patches.cpu_fused_norms.vllm_c_source import IS_CPU_SOURCE
from vllm_patch.upstream.meta import pick_patch
from vllm_patch.upstream.pr_format import find_ruff

FIXTURES = Path(__file__).parent / "fixtures"
CHECKOUTS = FIXTURES / "vllm_checkouts"
# Real files from vLLM's public history (license headers kept): the v0.32.0
# release (both norms, an IS_GPGPU_DEVICE name, multi-line skips) and commit
# 0d73436d (rms_norm only, the gate spelled out inline).
SHAPES = ["upstream-v0.32.0", "upstream-0d73436d"]
TARGET = RunIrNormTestsOnCpu.TARGET


SKIP = """\
@pytest.mark.skipif(
    {cond},
    reason="Currently only kernels on {on}",
)
"""
GPU_ON, CPU_ON = "CUDA, ROCm and XPU", "CUDA, ROCm, XPU and CPU"
GPU = "not current_platform.is_cuda_alike() and not current_platform.is_xpu()"
GPU_CPU = """\
not current_platform.is_cuda_alike()
    and not current_platform.is_xpu()
    and not current_platform.is_cpu()"""
REGISTRATION = 'def test_{op}_registration():\n    expected = {{"vllm_c": {gate}}}\n'
SUITES = {"rms_norm": RMS_NORM, "fused_add_rms_norm": FUSED_ADD_RMS_NORM}
GATE = "IS_GPGPU_DEVICE = current_platform.is_cuda_alike() or current_platform.is_xpu()"
GATE_CPU = """\
IS_GPGPU_DEVICE = (
    current_platform.is_cuda_alike()
    or current_platform.is_xpu()
    or current_platform.is_cpu()
)"""


def named_gate_file(cpu: bool, gated_too: bool) -> str:
    """Skips and expectations reading a module-level IS_GPGPU_DEVICE, as in vLLM
    0.32; ``gated_too``: rms_norm_gated reads it too. With ``cpu``, as the edit
    leaves it: the name widened once where only the norm tests read it, else
    each norm test's own skip and expectation (rms_norm_gated's stay)."""
    once = cpu and not gated_too
    out = [(GATE_CPU if once else GATE) + "\n\n\n"]
    for op in ["rms_norm", "fused_add_rms_norm"] + ["rms_norm_gated"] * gated_too:
        norm = SUITES.get(op)
        inline = cpu and gated_too and norm is not None
        cond = "not IS_GPGPU_DEVICE" + (f" and {NOT_CPU}" if inline else "")
        gate = "IS_GPGPU_DEVICE" + (f" or {IS_CPU_SOURCE}" if inline else "")
        skip = SKIP.format(cond=cond, on=CPU_ON if cpu and norm else GPU_ON)
        out.append(skip + REGISTRATION.format(op=op, gate=gate) + "\n\n")
        if norm is not None:
            out.append(skip + f"class {norm.suite}:\n    pass\n\n\n")
            out.append(norm.added + "\n\n" if cpu else "")
    return "".join(out).rstrip() + "\n"


SUITE_BEFORE = """\
IS_GPGPU_DEVICE = current_platform.is_cuda_alike()


@pytest.mark.skipif(not IS_GPGPU_DEVICE, reason="GPU only")
def test_rms_norm_registration():
    expected = {"vllm_c": IS_GPGPU_DEVICE}


@pytest.mark.skipif(not IS_GPGPU_DEVICE, reason="GPU only")
class TestRMSNorm:
    def test_native_semantics(self, dtype, n_tokens, hidden_size, epsilon):
        out2 = rms_norm_native(x * 2.0, weight, epsilon=epsilon)
        assert_close(ir.ops.rms_norm, out2, out)


@pytest.mark.skipif(not current_platform.is_rocm(), reason="ROCm strides")
def test_vllm_c_rms_norm_accepts_nd_input():
    pass


@pytest.mark.skipif(not current_platform.is_rocm(), reason="aiter")
def test_aiter_rejects_unsupported_dtypes():
    pass


@pytest.mark.skipif(not IS_GPGPU_DEVICE, reason="GPU only")
def test_fused_add_rms_norm_registration():
    expected = {"vllm_c": IS_GPGPU_DEVICE}


@pytest.mark.skipif(not IS_GPGPU_DEVICE, reason="GPU only")
class TestFusedAddRMSNorm:
    def test_impls(self, dtype, n_tokens, hidden_size, epsilon, provider):
        \"\"\"Against native.\"\"\"
        assert_close(ir.ops.fused_add_rms_norm, output, ref_output)
        assert_close(ir.ops.fused_add_rms_norm, residual, ref_residual)
"""
SUITE_AFTER = f"""\
IS_GPGPU_DEVICE = current_platform.is_cuda_alike() or current_platform.is_cpu()


@pytest.mark.skipif(not IS_GPGPU_DEVICE, reason="GPU only")
def test_rms_norm_registration():
    expected = {{"vllm_c": IS_GPGPU_DEVICE}}


@pytest.mark.skipif(not IS_GPGPU_DEVICE, reason="GPU only")
class TestRMSNorm:
    def test_native_semantics(self, dtype, n_tokens, hidden_size, epsilon):
        if current_platform.is_cpu() and dtype == torch.float32 and epsilon == 1e-5:
            pytest.skip(
                "seed 0 on CPU: epsilon term exceeds fp32 tolerance in scaling check"
            )
        out2 = rms_norm_native(x * 2.0, weight, epsilon=epsilon)
        assert_close(ir.ops.rms_norm, out2, out)


@pytest.mark.skipif(not current_platform.is_rocm(), reason="ROCm strides")
def test_vllm_c_rms_norm_accepts_nd_input():
    pass


{RMS_NORM.added}

@pytest.mark.skipif(not current_platform.is_rocm(), reason="aiter")
def test_aiter_rejects_unsupported_dtypes():
    pass


@pytest.mark.skipif(not IS_GPGPU_DEVICE, reason="GPU only")
def test_fused_add_rms_norm_registration():
    expected = {{"vllm_c": IS_GPGPU_DEVICE}}


{BF16_TOLERANCE_SOURCE}

@pytest.mark.skipif(not IS_GPGPU_DEVICE, reason="GPU only")
class TestFusedAddRMSNorm:
    def test_impls(self, dtype, n_tokens, hidden_size, epsilon, provider):
        \"\"\"Against native.\"\"\"
        assert_close_to_native(ir.ops.fused_add_rms_norm, output, ref_output)
        assert_close(ir.ops.fused_add_rms_norm, residual, ref_residual)


{FUSED_ADD_RMS_NORM.added}"""

# (name, before, after): every test below runs them both ways.
CASES = [
    (
        "inline gate: each skip gains the CPU check, wrapping as ruff does",
        SKIP.format(cond=GPU, on=GPU_ON)
        + REGISTRATION.format(op="rms_norm", gate="current_platform.is_cuda_alike()")
        + "\n\n"
        + SKIP.format(cond=GPU, on=GPU_ON)
        + "class TestRMSNorm:\n    pass\n",
        SKIP.format(cond=GPU_CPU, on=CPU_ON)
        + REGISTRATION.format(
            op="rms_norm",
            gate="current_platform.is_cuda_alike() or current_platform.is_cpu()",
        )
        + "\n\n"
        + SKIP.format(cond=GPU_CPU, on=CPU_ON)
        + "class TestRMSNorm:\n    pass\n\n\n"
        + RMS_NORM.added,
    ),
    (
        "a named gate only the norm tests read is widened once",
        named_gate_file(cpu=False, gated_too=False),
        named_gate_file(cpu=True, gated_too=False),
    ),
    (
        "a named gate rms_norm_gated reads too stays; each norm test's own skip "
        "and expectation gain CPU",
        named_gate_file(cpu=False, gated_too=True),
        named_gate_file(cpu=True, gated_too=True),
    ),
    (
        "in the test classes: the native semantics skip on CPU at fp32 and 1e-5, "
        "the fused output within the truncation; new tests beside ROCm's",
        SUITE_BEFORE,
        SUITE_AFTER,
    ),
]
IDS = [c[0] for c in CASES]


class TestRun(CodemodTest):
    TRANSFORM = RunIrNormTestsOnCpu

    def test_cases(self) -> None:
        for name, before, after in CASES:
            with self.subTest(name):
                self.assertCodemod(before, after)

    def test_already_edited_is_unchanged(self) -> None:
        for name, _, after in CASES:
            with self.subTest(name):
                self.assertCodemod(after, after)


class TestStop(CodemodTest):
    TRANSFORM = StopIrNormTestsOnCpu

    def test_cases_reverse(self) -> None:
        for name, before, after in CASES:
            with self.subTest(name):
                self.assertCodemod(after, before)

    def test_unedited_is_unchanged(self) -> None:
        for name, before, _ in CASES:
            with self.subTest(name):
                self.assertCodemod(before, before)


def ruff_format_check(path: Path) -> subprocess.CompletedProcess:
    ruff = find_ruff()
    if ruff is None:
        pytest.skip("ruff is not installed")
    return subprocess.run(
        [str(ruff), "format", "--isolated", "--line-length=88", "--check", str(path)],
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_real_upstream_files_round_trip_byte_exactly_and_stay_ruff_formatted(
    shape: str, tmp_path: Path
) -> None:
    original = (CHECKOUTS / shape / TARGET).read_bytes()
    edited = run_codemod(RunIrNormTestsOnCpu, original.decode(), read_tree_file=None)

    assert edited != original.decode()
    assert edited.startswith("# SPDX-License-Identifier: Apache-2.0\n")
    assert run_codemod(RunIrNormTestsOnCpu, edited, read_tree_file=None) == edited
    assert run_codemod(StopIrNormTestsOnCpu, edited, None).encode() == original
    written = tmp_path / "test_layernorm.py"
    written.write_text(edited)
    assert ruff_format_check(written).returncode == 0
    ops = ["rms_norm", "fused_add_rms_norm"][: 2 if "v0.32.0" in shape else 1]
    for norm in (RMS_NORM, FUSED_ADD_RMS_NORM):
        assert (f"def {norm.added_name}(" in edited) == (norm.op in ops)


def test_the_v0_32_0_file_changes_its_gate_once_and_adds_tests_beside_rocms() -> None:
    original = (CHECKOUTS / "upstream-v0.32.0" / TARGET).read_text()
    edited = run_codemod(RunIrNormTestsOnCpu, original, read_tree_file=None)

    # The gate once, the two stride tests' skips, the native semantics skip and
    # the tolerance helper: each a CPU check of its own, none repeated.
    assert original.count(IS_CPU_SOURCE) == 0
    assert edited.count(IS_CPU_SOURCE) == 1 + 2 + 1 + 1
    assert "or current_platform.is_cpu()\n)\n" in edited  # IS_GPGPU_DEVICE
    assert "not IS_GPGPU_DEVICE and" not in edited
    assert "IS_GPGPU_DEVICE or" not in edited
    assert max(len(line) for line in edited.splitlines()) <= 88
    tops = [
        line.split("(")[0] for line in edited.splitlines() if line.startswith("def ")
    ]
    for norm, sibling in [
        (RMS_NORM, "def test_vllm_c_rms_norm_accepts_transposed_input"),
        (FUSED_ADD_RMS_NORM, "def test_vllm_c_fused_add_rms_norm_accepts_nd_input"),
    ]:
        assert tops[tops.index(sibling) + 1] == f"def {norm.added_name}"


@pytest.mark.parametrize(
    "source,looked_for,found",
    [
        ("import torch\n", "test_rms_norm_registration and TestRMSNorm", "none"),
        (
            "def test_rms_norm_registration():\n    pass\n",
            "test_rms_norm_registration and TestRMSNorm",
            "test_rms_norm_registration",
        ),
        (
            "def test_rms_norm_registration():\n    pass\n\n\n"
            "class TestRMSNorm:\n    pass\n",
            "one @pytest.mark.skipif(condition, reason=...)",
            "0 such decorators",
        ),
        (
            SKIP.format(cond="    not GPU", on="GPU")
            + "\ndef test_rms_norm_registration():\n    expected = {}\n\n\n"
            + SKIP.format(cond="    not GPU", on="GPU")
            + "\nclass TestRMSNorm:\n    pass\n",
            '"vllm_c": ... entry',
            "0 such entries",
        ),
    ],
    ids=["no norm tests", "no test class", "no skipif", "no vllm_c expectation"],
)
def test_unknown_shapes_name_what_was_looked_for(source, looked_for, found) -> None:
    with pytest.raises(ShapeNotRecognised) as caught:
        run_codemod(RunIrNormTestsOnCpu, source, read_tree_file=None)
    assert caught.value.path == TARGET
    assert looked_for in caught.value.looked_for
    assert found in caught.value.found


def checkout_tree(tmp_path: Path, shape: str, test_source: str | None = None):
    """The fixture's vLLM sources with a shape's upstream tests, as a checkout."""
    root = tmp_path / "vllm"
    shutil.copytree(FIXTURES / "vllm_tree", root)
    shutil.copytree(CHECKOUTS / shape / "tests", root / "tests")
    if test_source is not None:
        (root / TARGET).write_text(test_source)
    return open_tree(root)


@pytest.mark.parametrize(
    "test_source,status",
    [(None, PlanStatus.APPLICABLE), ("import torch\n", PlanStatus.SKIPPED)],
    ids=["recognised", "unrecognised"],
)
def test_a_tree_with_tests_gets_the_test_edit_or_says_why_not(
    tmp_path: Path, test_source, status
) -> None:
    tree = checkout_tree(tmp_path, "upstream-v0.32.0", test_source)
    before = tree.read_bytes(TARGET)
    patch = pick_patch("cpu_fused_norms")

    plan = engine.plan(tree, patch)

    assert plan.status is PlanStatus.APPLICABLE and not plan.errors
    assert [e.status() for e in plan.edits][-1] is status
    if status is PlanStatus.SKIPPED:
        assert f"{TARGET} left out" in "\n".join(plan.warnings)
        assert "source shape not recognised" in "\n".join(plan.warnings)
    engine.apply(tree, patch)
    assert (tree.read_bytes(TARGET) != before) == (status is PlanStatus.APPLICABLE)
    engine.revert(tree, patch)
    assert tree.read_bytes(TARGET) == before


def test_a_tree_without_tests_gets_only_the_source_edits(tmp_path: Path) -> None:
    root = tmp_path / "site"
    shutil.copytree(FIXTURES / "vllm_tree", root)
    plan = engine.plan(open_tree(root), pick_patch("cpu_fused_norms"))
    assert TARGET not in [e.edit.file for e in plan.edits]
