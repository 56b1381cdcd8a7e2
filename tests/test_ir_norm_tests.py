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
    FUSED_ADD_RMS_NORM,
    RMS_NORM,
    RunIrNormTestsOnCpu,
    StopIrNormTestsOnCpu,
)
from vllm_patch.upstream.meta import pick_patch
from vllm_patch.upstream.pr_format import find_ruff

FIXTURES = Path(__file__).parent / "fixtures"
CHECKOUTS = FIXTURES / "vllm_checkouts"
# Real files from vLLM's public history (license headers kept): the v0.32.0
# release (both norms, an IS_GPGPU_DEVICE name, multi-line skips) and commit
# 0d73436d (rms_norm only, the gate spelled out inline).
SHAPES = ["upstream-v0.32.0", "upstream-0d73436d"]
TARGET = RunIrNormTestsOnCpu.TARGET


def added(*norms) -> str:
    return "".join(f"\n\n{n.added}" for n in norms)


REGISTRATION = """
def test_{op}_registration():
    expected = {{
        "native": True,
        "vllm_c": {vllm_c},
    }}
"""
GPU = "not current_platform.is_cuda_alike() and not current_platform.is_xpu()"
GPU_CPU = """\
    not current_platform.is_cuda_alike()
    and not current_platform.is_xpu()
    and not current_platform.is_cpu()"""
SKIP = '@pytest.mark.skipif(\n{cond},\n    reason="Currently only kernels on {on}",\n)'


def named_gate_file(cpu: bool) -> str:
    """Skips and expectations on a module-level gate name, as in vLLM 0.32;
    with ``cpu``, as the edit leaves the two norms' tests (not rms_norm_gated)."""
    out = []
    for op, name in [
        ("rms_norm", "test"),
        ("rms_norm", "TestRMSNorm"),
        ("rms_norm_gated", "test"),
        ("fused_add_rms_norm", "test"),
        ("fused_add_rms_norm", "TestFusedAddRMSNorm"),
    ]:
        edited = cpu and op != "rms_norm_gated"
        cond = "    not IS_GPGPU_DEVICE"
        cond += " and not current_platform.is_cpu()" if edited else ""
        on = "CUDA, ROCm, XPU and CPU" if edited else "CUDA, ROCm and XPU"
        gate = (
            "IS_GPGPU_DEVICE or current_platform.is_cpu()"
            if edited
            else "IS_GPGPU_DEVICE"
        )
        body = (
            REGISTRATION.format(op=op, vllm_c=gate)
            if name == "test"
            else f"\nclass {name}:\n    pass\n"
        )
        out.append(SKIP.format(cond=cond, on=on) + body + "\n\n")
    return "".join(out).rstrip() + "\n"


SUITE = """
class TestRMSNorm:
    @classmethod
    def setup_class(cls):
        pass

{native}    def test_native_semantics(self, dtype):
        pass

    @pytest.mark.parametrize("provider", ["vllm_c", "aiter", "native"])
    def test_torch_opcheck(self, dtype, provider):
{guard}        if not ir.ops.rms_norm.impls[provider].supported:
            pytest.skip(f"{{provider}} impl not supported on this platform")

    @pytest.mark.parametrize("provider", supported_providers(ir.ops.rms_norm))
    def test_impls(self, dtype, provider):
        pass

    @pytest.mark.parametrize("provider", ["vllm_c"])
    def test_inplace_semantics(self, dtype, provider):
        \"\"\"Only vllm_c.\"\"\"
        pass
"""
NATIVE_SKIP = """\
    @pytest.mark.skipif(
        current_platform.is_cpu(), reason="On CPU, only the vllm_c kernels are tested"
    )
"""
PROVIDER_SKIP = """\
        if current_platform.is_cpu() and provider != "vllm_c":
            pytest.skip("On CPU, only the vllm_c kernels are tested")
"""


def suite(cpu: bool) -> str:
    """A test class with every kind of test: with ``cpu``, as the edit leaves it
    (the native test and the native provider stay skipped on CPU; tests over
    vLLM's supported providers or over vllm_c alone are left as they are)."""
    return SUITE.format(
        native=NATIVE_SKIP if cpu else "",
        guard=PROVIDER_SKIP if cpu else "",
    )


# (name, before, after): every test below runs them both ways.
CASES = [
    (
        "inline gate: the condition no longer fits one line, so it wraps",
        SKIP.format(cond=f"    {GPU}", on="CUDA, ROCm and XPU")
        + REGISTRATION.format(op="rms_norm", vllm_c="current_platform.is_cuda_alike()")
        + "\n\n"
        + SKIP.format(cond=f"    {GPU}", on="CUDA, ROCm and XPU")
        + "\nclass TestRMSNorm:\n    pass\n",
        SKIP.format(cond=GPU_CPU, on="CUDA, ROCm, XPU and CPU")
        + REGISTRATION.format(
            op="rms_norm",
            vllm_c="current_platform.is_cuda_alike() or current_platform.is_cpu()",
        )
        + "\n\n"
        + SKIP.format(cond=GPU_CPU, on="CUDA, ROCm, XPU and CPU")
        + "\nclass TestRMSNorm:\n    pass\n"
        + added(RMS_NORM),
    ),
    (
        "a named gate, both norms; the rms_norm_gated tests keep their skip",
        named_gate_file(cpu=False),
        named_gate_file(cpu=True) + added(RMS_NORM, FUSED_ADD_RMS_NORM),
    ),
    (
        "a one-line skip without a trailing comma stays on one line; "
        "another reason stays as it is",
        '@pytest.mark.skipif(not GPU, reason="GPU only")'
        + REGISTRATION.format(op="rms_norm", vllm_c="GPU")
        + '\n\n@pytest.mark.skipif(not GPU, reason="GPU only")\n'
        + "class TestRMSNorm:\n    pass\n",
        '@pytest.mark.skipif(not GPU and not current_platform.is_cpu(), reason="GPU only")'
        + REGISTRATION.format(op="rms_norm", vllm_c="GPU or current_platform.is_cpu()")
        + "\n\n"
        + '@pytest.mark.skipif(not GPU and not current_platform.is_cpu(), reason="GPU only")\n'
        + "class TestRMSNorm:\n    pass\n"
        + added(RMS_NORM),
    ),
    (
        "in the test class, what is not about vllm_c stays skipped on CPU",
        SKIP.format(cond="    not GPU", on="GPU")
        + REGISTRATION.format(op="rms_norm", vllm_c="GPU")
        + "\n\n"
        + SKIP.format(cond="    not GPU", on="GPU")
        + suite(cpu=False),
        SKIP.format(
            cond="    not GPU and not current_platform.is_cpu()", on="GPU and CPU"
        )
        + REGISTRATION.format(op="rms_norm", vllm_c="GPU or current_platform.is_cpu()")
        + "\n\n"
        + SKIP.format(
            cond="    not GPU and not current_platform.is_cpu()", on="GPU and CPU"
        )
        + suite(cpu=True)
        + added(RMS_NORM),
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
