"""patcher.e2e: the random Llama and the subprocess vLLM runner, on a tiny model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from conftest import requires_vllm

from patcher import e2e

TINY = e2e.TINY_LLAMA

requires_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is absent"
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is absent")
    return e2e.make_random_llama(tmp_path_factory.mktemp("models"), **TINY)


@pytest.mark.parametrize(
    ("log", "expected"),
    [
        ("", None),
        ("INFO unrelated line\n", None),
        (
            "INFO 11-29 [kernel.py:468] Final IR op priority after setting platform "
            "defaults: IrOpPriorityConfig(rms_norm=['native'])\n",
            "IrOpPriorityConfig(rms_norm=['native'])",
        ),
        (  # logged by more than one process: the last one wins
            "x Final IR op priority after setting platform defaults: A\n"
            "y Final IR op priority after setting platform defaults: B\n",
            "B",
        ),
    ],
)
def test_parse_final_priority(log, expected):
    assert e2e.parse_final_priority(log) == expected


@requires_transformers
def test_random_llama_is_cached_by_config(tmp_path):
    first = e2e.make_random_llama(tmp_path, **TINY)
    stamp = (first / "config.json").stat().st_mtime_ns
    again = e2e.make_random_llama(tmp_path, **TINY)
    other = e2e.make_random_llama(tmp_path, **{**TINY, "seed": 1})
    assert again == first
    assert (again / "config.json").stat().st_mtime_ns == stamp
    assert other != first
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [first.name, other.name]
    )
    assert list(first.glob("*.safetensors"))


@requires_vllm
def test_run_generate_eager_reports_rates_tokens_and_priority(tiny_model):
    result = e2e.run_generate(
        tiny_model,
        ir_op_priority={"rms_norm": ["native"], "fused_add_rms_norm": ["native"]},
        compiled=False,
        prompt_len=8,
        max_tokens=4,
        batch=2,
        repeats=2,
        timeout=600,
    )
    assert result["ok"], result["error"] + "\n" + result["log_tail"]
    assert result["error"] is None
    assert len(result["tokens_per_s"]) == 2
    assert all(rate > 0 for rate in result["tokens_per_s"])
    assert [len(ids) for ids in result["output_token_ids"]] == [4, 4]
    assert "rms_norm=['native'" in result["final_priority"]
    assert "fused_add_rms_norm=['native'" in result["final_priority"]


@requires_vllm
def test_run_generate_reports_a_failed_engine(tiny_model):
    result = e2e.run_generate(
        tiny_model,
        ir_op_priority={"rms_norm": ["no_such_provider", "native"]},
        compiled=False,
        max_tokens=2,
        timeout=600,
    )
    assert not result["ok"]
    assert result["error"]
    assert result["tokens_per_s"] == []
