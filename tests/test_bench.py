"""vllm-patch bench: it runs a short configuration against the real vLLM, it
checks numerics before timing, its output keeps its schema, and its
recommendation follows from the numbers. Nothing here asserts that anything
is fast."""

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import requires_vllm

from vllm_patch.bench.cli import configuration
from vllm_patch.bench.collect import collect
from vllm_patch.bench.e2e_step import first_difference
from vllm_patch.bench.engine_run import TINY_LLAMA
from vllm_patch.bench.outputs import write_outputs
from vllm_patch.bench.recommend import (
    clarity,
    priority_snippets,
    recommend,
    unclear_ops,
)
from vllm_patch.runtime import bench_result
from vllm_patch.runtime.bench_result import DISPATCH_ROLES
from vllm_patch.runtime.cache import CACHE_ENV

ROOT = Path(__file__).resolve().parent.parent


def row(op, provider, us, *, status="ok", tokens=1, threads=1, source="installed"):
    return {
        "op": op, "provider": provider, "status": status, "median_us": us,
        "dtype": "bfloat16", "num_tokens": tokens, "hidden_size": 2048,
        "threads": threads, "source": source,
    }  # fmt: skip


def pair(mode, ratio, provider="fused", ops=("rms_norm",)):
    return {"mode": mode, "provider": provider, "ops": list(ops), "ratio": ratio}


def native_compiled_and(provider_us, compiled_us=30.0, **kw):
    return [
        row("rms_norm", "native", 30.0, **kw),
        row("rms_norm", "native_compiled", compiled_us, **kw),
        row("rms_norm", "fused", provider_us, **kw),
    ]


# (rows, e2e pairs, expected eager priority, expected compiled priority)
CASES = {
    "fast per op, no e2e": (
        native_compiled_and(3.0), [], ["fused", "native"], ["fused", "native"]
    ),
    "fast per op, compiled e2e not faster": (
        native_compiled_and(3.0),
        [pair("eager", 1.10), pair("compiled", 0.98)],
        ["fused", "native"],
        ["native"],
    ),
    "fast per op, compiled e2e faster": (
        native_compiled_and(3.0),
        [pair("eager", 1.10), pair("compiled", 1.05)],
        ["fused", "native"],
        ["fused", "native"],
    ),
    "fast per op but slower end to end in eager": (
        native_compiled_and(3.0), [pair("eager", 0.90)], ["native"], ["fused", "native"]
    ),
    "within the margin": (
        native_compiled_and(29.0, compiled_us=29.5), [], ["native"], ["native"]
    ),
    "slower than native": (native_compiled_and(60.0), [], ["native"], ["native"]),
    "faster than native, slower than compiled native": (
        native_compiled_and(20.0, compiled_us=10.0), [], ["fused", "native"], ["native"]
    ),
    "wrong somewhere: never recommended": (
        native_compiled_and(3.0) + [row("rms_norm", "fused", None, status="wrong",
                                        tokens=16)],
        [],
        ["native"],
        ["native"],
    ),
    "no alternative": (
        [row("rms_norm", "native", 30.0), row("rms_norm", "native_compiled", 9.0)],
        [],
        ["native"],
        ["native"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_recommendation_follows_the_numbers(case):
    rows, pairs, eager, compiled = case
    recs = {
        r["mode"]: r for r in recommend(rows, pairs, upstream_fused_ops={"rms_norm"})
    }
    assert recs["eager"]["priority"] == eager
    assert recs["compiled"]["priority"] == compiled
    assert recs["eager"]["agrees_with_upstream"] == (eager != ["native"])
    assert recs["compiled"]["agrees_with_upstream"] == (compiled == ["native"])


def test_ratios_pair_only_runs_from_the_same_process():
    # The provider's rows come from a patched copy; the installed native is not
    # its baseline, the copy's own native is.
    rows = [
        row("rms_norm", "native", 30.0),
        row("rms_norm", "native", 4.0, source="copy"),
        row("rms_norm", "vllm_c", 3.0, source="copy"),
    ]
    (eager,) = [r for r in recommend(rows) if r["mode"] == "eager"]
    assert eager["priority"] == ["vllm_c", "native"]
    assert eager["considered"][0]["per_op_speedup"] == pytest.approx(4.0 / 3.0)


def test_best_of_several_providers_wins():
    rows = native_compiled_and(10.0) + [row("rms_norm", "other", 5.0)]
    (eager,) = [r for r in recommend(rows) if r["mode"] == "eager"]
    assert eager["priority"] == ["other", "native"]


def test_a_provider_usable_as_installed_beats_one_that_needs_the_patch():
    rows = native_compiled_and(10.0) + [
        row("rms_norm", "native", 30.0, source="copy"),
        row("rms_norm", "upstream", 2.0, source="copy"),
    ]
    (eager,) = [r for r in recommend(rows) if r["mode"] == "eager"]
    assert eager["priority"] == ["fused", "native"]


def test_a_compiled_end_to_end_run_outweighs_per_op_figures_of_another_provider():
    rows = native_compiled_and(3.0) + [row("rms_norm", "twin", 1.0)]
    recs = recommend(rows, [pair("compiled", 1.0)])
    (compiled,) = [r for r in recs if r["mode"] == "compiled"]
    assert compiled["priority"] == ["native"]


def test_snippets_carry_the_recommended_priorities():
    recs = recommend(native_compiled_and(3.0), [pair("compiled", 0.9)])
    snippets = priority_snippets(recs)
    assert snippets["eager"]["ir_op_priority"] == {"rms_norm": ["fused", "native"]}
    assert snippets["compiled"]["ir_op_priority"] == {"rms_norm": ["native"]}
    eager_config = snippets["eager"]["cli"].split("--kernel-config ", 1)[1].strip("'")
    assert json.loads(eager_config) == {
        "ir_op_priority": {"rms_norm": ["fused", "native"]}
    }
    assert "--enforce-eager" in snippets["eager"]["cli"]
    assert "--enforce-eager" not in snippets["compiled"]["cli"]


def timed(op, provider, us, **kw):
    return {**row(op, provider, us, **kw), "q1_us": us, "q3_us": us}


def dispatch_row(role, provider, us):
    vs = {"reference": 6.0, "upstream": 5.0}  # the medians of those two rows
    return {
        **timed("rms_norm", provider, us, source="patched copy (p)"),
        "role": role,
        **{f"vs_{other}": us / base for other, base in vs.items()},
    }


DISPATCH_ROWS = [
    dispatch_row("native", "native", 30.0),
    dispatch_row("upstream", "vllm_c", 5.0),
    dispatch_row("reference", "vllm_c_min", 6.0),
    dispatch_row("provider", "vllm_c_cpu", 6.3),
]
EVIDENCE_DOC = {
    "started": "then", "versions": {"vllm": "0.32.0", "torch": "2.13.0"},
    "machine": {"cpu_model": "cpu", "arch": "x86_64", "usable_cpus": 1,
                "key_flags": []},
    "interference": {}, "e2e": None, "recommendation": [],
    "perop": {
        "rows": [timed("rms_norm", "native", 30.0, source="patched copy (p)"),
                 {**timed("rms_norm", "vllm_c", 3.0, source="patched copy (p)"),
                  "ratio": 10.0}],
        "dispatch": DISPATCH_ROWS,
    },
}  # fmt: skip
VIEWS = {
    "the bench's view": (
        lambda: bench_result.dispatch_markdown(DISPATCH_ROWS),
        ["native", "vllm_c", "vllm_c_min", "vllm_c_cpu"],
        {"vllm_c_cpu / vllm_c_min": "1.05x", "vllm_c_cpu / vllm_c": "1.26x",
         "native / vllm_c": "6.00x"},
    ),
    "an upstream PR's view": (
        lambda: bench_result.evidence_markdown(EVIDENCE_DOC, providers=("vllm_c",)),
        ["native", "vllm_c"],
        {"native / vllm_c": "6.00x"},
    ),
}  # fmt: skip


@pytest.mark.parametrize("render, columns, ratios", VIEWS.values(), ids=VIEWS.keys())
def test_the_dispatch_table_shows_the_ratios_of_the_columns_it_has(
    render, columns, ratios
):
    lines = render().splitlines()
    header = next(line for line in lines if line.startswith("| op |"))
    cells = [c.strip() for c in header.strip("| ").split(" | ")]
    assert [c.split(" (")[0] for c in cells[5:]] == columns + list(ratios)
    values = next(line for line in lines if line.startswith("| `rms_norm`"))
    assert values.strip("| ").split(" | ")[-len(ratios) :] == [
        f"**{r}**" for r in ratios.values()
    ]


# --- against the real vLLM ---------------------------------------------------


@requires_vllm
def test_a_wrong_implementation_is_rejected_and_never_timed():
    import torch
    from vllm import ir

    from vllm_patch.bench.perop import measure

    op = ir.ops.rms_norm
    calls = {"wrong": 0, "right": 0}

    # Real annotations (no __future__ import here): IR impls need a schema.
    def wrong(
        x: torch.Tensor,
        weight: torch.Tensor | None,
        epsilon: float,
        variance_size: int | None = None,
    ) -> torch.Tensor:
        calls["wrong"] += 1
        return op.impls["native"].impl_fn(x, weight, epsilon, variance_size) * 1.5

    def right(
        x: torch.Tensor,
        weight: torch.Tensor | None,
        epsilon: float,
        variance_size: int | None = None,
    ) -> torch.Tensor:
        calls["right"] += 1
        return op.impls["native"].impl_fn(x, weight, epsilon, variance_size)

    for name, fn in (
        ("vllm_patch_test_wrong", wrong),
        ("vllm_patch_test_right", right),
    ):
        if name not in op.impls:
            op.register_impl(name)(fn)
        op.impls[name].impl_fn = fn  # this test's counters, also on a rerun

    result = measure(
        {
            "ops": ["rms_norm"], "num_tokens": [1, 4], "hidden_sizes": [256],
            "dtypes": ["float32"], "threads": torch.get_num_threads(),
            "compile": False, "samples": 3, "min_sample_s": 0.0002,
            "time_only": ["vllm_patch_test_wrong", "vllm_patch_test_right"],
        }
    )  # fmt: skip
    by = {}
    for r in result["rows"]:
        by.setdefault(r["provider"], []).append(r)
    assert [r["status"] for r in by["vllm_patch_test_wrong"]] == ["wrong", "wrong"]
    assert all("median_us" not in r for r in by["vllm_patch_test_wrong"])
    assert all("outside tolerance" in r["error"] for r in by["vllm_patch_test_wrong"])
    assert calls["wrong"] == 2  # one numerics check per shape, nothing more
    assert [r["status"] for r in by["vllm_patch_test_right"]] == ["ok", "ok"]
    assert calls["right"] > 2 * 3  # checked, then timed
    assert all(r["median_us"] > 0 for r in by["vllm_patch_test_right"])


ROW_FIELDS = {
    "op": str, "provider": str, "source": str, "dtype": str, "num_tokens": int,
    "hidden_size": int, "threads": int, "status": str, "atol": float, "rtol": float,
}  # fmt: skip
# What vLLM's RMSNorm layer calls (model_executor/layers/layernorm.py).
CALLED_AS = {
    "rms_norm": "rms_norm",
    "fused_add_rms_norm": "fused_add_rms_norm.maybe_inplace",
}
TIMED_FIELDS = ("median_us", "q1_us", "q3_us", "iqr_us", "min_us", "ratio")


def _vllm_c_source() -> bytes:
    spec = importlib.util.find_spec("vllm")
    return (Path(spec.origin).parent / "kernels" / "vllm_c.py").read_bytes()


@requires_vllm
@pytest.mark.slow  # a whole (quick) bench run: minutes; `-m slow` runs it
def test_a_short_bench_runs_and_keeps_its_schema(tmp_path, monkeypatch):
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is absent")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    installed_before = hashlib.sha256(_vllm_c_source()).hexdigest()
    args = type("Args", (), {"quick": True, "threads": [1], "e2e": True, "ops": None})
    cfg = configuration(args)
    cfg.update(
        ops=["rms_norm", "fused_add_rms_norm"], num_tokens=[4], samples=3,
        e2e_repeats=1, e2e_max_tokens=4, e2e_prompt_len=4,
        model=TINY_LLAMA,
    )  # fmt: skip
    doc = collect(cfg, progress=lambda _m: None)

    # The installed vLLM is untouched by the patched copy.
    assert hashlib.sha256(_vllm_c_source()).hexdigest() == installed_before
    assert doc["schema"] == "vllm-patch-bench/1"
    assert doc["machine"]["usable_cpus"] >= 1 and doc["machine"]["cpu_model"]
    assert doc["versions"]["vllm"] and doc["versions"]["torch"]
    rows = doc["perop"]["rows"]
    for r in rows:
        for key, kind in ROW_FIELDS.items():
            assert isinstance(r[key], kind), (key, r)
        if r["status"] == "ok":
            for key in TIMED_FIELDS:
                assert r[key] > 0, (key, r)
            assert r["q1_us"] <= r["median_us"] <= r["q3_us"]
    seen = {(r["op"], r["provider"]) for r in rows}
    for op in ("rms_norm", "fused_add_rms_norm"):
        assert {(op, "native"), (op, "native_compiled")} <= seen
    # Every implementation the installed tree or a patched copy offers is measured.
    offered = {
        (r["op"], r["provider"], r["source"]) for r in rows if r["provider"] != "native"
    }
    for op, impls in doc["perop"]["inventory"].items():
        for provider, supported in impls.items():
            if supported and provider != "native":
                assert (op, provider, "installed") in offered
    assert {r["source"] for r in rows} >= {"installed"}

    # Through IR dispatch, in the patched copy (where the upstream vllm_c is
    # enabled): native, vllm_c, the minimal reference and the provider, each
    # checked, dispatched to and timed, with its ratios to the reference and vllm_c.
    dispatch = doc["perop"]["dispatch"]
    assert {(r["op"], r["role"], r["status"]) for r in dispatch} == {
        (op, role, "ok")
        for op in ("rms_norm", "fused_add_rms_norm")
        for role in DISPATCH_ROLES
    }
    for r in dispatch:
        assert r["source"] == "patched copy (cpu_fused_norms)"
        assert r["num_tokens"] == 1 and r["threads"] == 1
        assert r["call"] == CALLED_AS[r["op"]]
        assert r["vs_reference"] > 0 and r["vs_upstream"] > 0
    assert {r["provider"] for r in dispatch} == {
        "native", "vllm_c", "vllm_c_cpu", "vllm_c_cpu_minimal"
    }  # fmt: skip

    recs = doc["recommendation"]
    assert {(r["op"], r["mode"]) for r in recs} == {
        (op, mode)
        for op in ("rms_norm", "fused_add_rms_norm")
        for mode in ("eager", "compiled")
    }
    # The document's recommendation is the pure function of its own numbers.
    pairs = doc["e2e"]["pairs"] if doc["e2e"] else []
    fused_ops = {r["op"] for r in recs if r["upstream_rule"] == "fused"}
    busy = max((v for v in doc["interference"].values() if v is not None), default=None)
    again = recommend(rows, pairs, upstream_fused_ops=fused_ops, busy=busy)
    assert json.loads(json.dumps(again)) == json.loads(json.dumps(recs))
    # End to end, each against native in its own vLLM: the out-of-tree provider
    # as installed, and vllm_c in the patched copy (the vLLM the PR produces).
    assert sorted((p["provider"], p["source"]) for p in pairs) == [
        ("vllm_c", "patched copy (cpu_fused_norms)"),
        ("vllm_c_cpu", "installed"),
    ]
    for pair_ in pairs:
        assert pair_["mode"] == "eager"
        for name in ("native", "fused"):
            run = pair_[name]
            assert run["ok"], run.get("error")
            assert run["median_tokens_per_s"] > 0
        # vLLM's own log shows the priority each run asked for.
        assert f"rms_norm=['{pair_['provider']}'" in pair_["fused"]["final_priority"]
        assert "rms_norm=['native'" in pair_["native"]["final_priority"]

    paths = write_outputs(doc, tmp_path / "out")
    assert json.loads(paths["json"].read_text())["schema"] == doc["schema"]
    text = paths["markdown"].read_text()
    assert "## Per op" in text and "## Recommendation for this machine" in text
    assert "### Per call through IR dispatch" in text
    assert (
        "| vllm_c_cpu / vllm_c_cpu_minimal | vllm_c_cpu / vllm_c | native / vllm_c |"
        in text
    )
    assert paths["chart"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert doc["machine"]["cpu_model"] in paths["machine"].read_text()


def spread(op, provider, us, q1, q3, **kw):
    return {**row(op, provider, us, **kw), "q1_us": q1, "q3_us": q3}


# (native (median, q1, q3), fused (median, q1, q3), expected clarity)
CLARITY = {
    "clearly faster": ((30, 29, 31), (3, 2.9, 3.1), "faster"),
    "clearly slower": ((30, 29, 31), (60, 58, 62), "not faster"),
    "medians apart, quartiles overlapping": ((30, 20, 40), (25, 18, 35), "inconclusive"),
}  # fmt: skip


@pytest.mark.parametrize(
    "native, fused, clarity_", CLARITY.values(), ids=CLARITY.keys()
)
def test_a_difference_counts_only_when_the_spread_clears_it(native, fused, clarity_):
    rows = [spread("rms_norm", "native", *native), spread("rms_norm", "fused", *fused)]
    assert clarity(rows, "rms_norm", "fused") == clarity_
    assert unclear_ops(rows, "installed") == (
        ["rms_norm"] if clarity_ == "inconclusive" else []
    )
    (eager,) = [r for r in recommend(rows, upstream_fused_ops={"rms_norm"})
                if r["mode"] == "eager"]  # fmt: skip
    if clarity_ == "inconclusive":
        assert eager["choice"] == "inconclusive" and eager["priority"] is None
        assert eager["basis"].startswith("inconclusive, keep the upstream rule")
        assert "rms_norm" not in priority_snippets([eager])["eager"]["ir_op_priority"]


@pytest.mark.parametrize(
    "busy, choice", [(None, "fused"), (0.1, "fused"), (0.6, "inconclusive")]
)
def test_figures_measured_on_a_busy_machine_recommend_nothing(busy, choice):
    recs = recommend(native_compiled_and(3.0), busy=busy)
    assert {r["choice"] for r in recs} == {choice}
    if choice == "inconclusive":
        assert all("60% of the CPU time" in r["basis"] for r in recs)
        assert priority_snippets(recs)["eager"]["ir_op_priority"] == {}


def test_a_provider_only_a_patched_copy_offers_needs_apply():
    rows = [
        row("rms_norm", "native", 30.0, source="copy"),
        row("rms_norm", "vllm_c", 3.0, source="copy"),
    ]
    (eager,) = [r for r in recommend(rows) if r["mode"] == "eager"]
    assert eager["priority"] == ["vllm_c", "native"] and eager["needs_apply"]
    assert "needs `vllm-patch apply`" in eager["basis"]


@pytest.mark.parametrize(
    "native, fused, expected",
    [
        ([[1, 2, 3]], [[1, 2, 3]], None),
        ([[1, 2, 3]], [[1, 5, 6]], {"position": 1, "of": 3}),
        ([[1, 2, 3], [4, 5, 6]], [[1, 2, 9], [7, 5, 6]], {"position": 0, "of": 3}),
        (None, [[1]], None),
    ],
)
def test_where_two_runs_part(native, fused, expected):
    assert first_difference(native, fused) == expected


@requires_vllm
@pytest.mark.integration
def test_a_failing_end_to_end_step_keeps_the_per_op_results(broken_venv, tmp_path):
    """PyPI's torchvision beside the +cpu torch breaks transformers: the random
    Llama cannot be built. The per-op figures are kept, the failure is recorded
    with its reason, and the exit code says so."""
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        CACHE_ENV: str(tmp_path / "cache"),  # no model built before
    }
    proc = subprocess.run(
        [broken_venv, "-m", "vllm_patch", "bench", "--quick", "--threads", "1",
         "--ops", "rms_norm", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    doc = json.loads((out / "bench.json").read_text())
    assert any(r["status"] == "ok" for r in doc["perop"]["rows"])
    (failed,) = doc["e2e"]["failed"]
    assert "torchvision" in failed
    assert f"**Failed:** {failed}" in (out / "bench.md").read_text()
    assert f"end to end FAILED: {failed}" in proc.stderr
    assert (out / "perop_ratios.png").is_file()


def test_vllm_patch_bench_without_vllm_is_a_usage_error(tmp_path, monkeypatch, capsys):
    """``bench`` reaches ``vllm-patch`` through its entry point; with no vLLM to
    measure it refuses before writing anything."""
    from patcher.errors import ExitCode
    from vllm_patch.cli import main

    monkeypatch.setitem(sys.modules, "vllm", None)  # not importable here
    assert main(["bench", "--out", str(tmp_path / "out")]) == ExitCode.USAGE
    assert "vLLM is not importable" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
