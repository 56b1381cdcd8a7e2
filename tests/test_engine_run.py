"""vllm_patch.bench.engine_run: the random Llama and the subprocess vLLM runner, on a tiny model."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from conftest import requires_vllm

# The provider imports torch: without it (the fast tier) this module is skipped.
pytest.importorskip("torch")
from patches.cpu_fused_norms import provider
from vllm_patch.bench import engine_run

TINY = engine_run.TINY_LLAMA

requires_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is absent"
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is absent")
    return engine_run.make_random_llama(tmp_path_factory.mktemp("models"), **TINY)


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
    assert engine_run.parse_final_priority(log) == expected


@requires_transformers
def test_random_llama_is_cached_by_config(tmp_path):
    first = engine_run.make_random_llama(tmp_path, **TINY)
    stamp = (first / "config.json").stat().st_mtime_ns
    again = engine_run.make_random_llama(tmp_path, **TINY)
    other = engine_run.make_random_llama(tmp_path, **{**TINY, "seed": 1})
    assert again == first
    assert (again / "config.json").stat().st_mtime_ns == stamp
    assert other != first
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [first.name, other.name]
    )
    assert list(first.glob("*.safetensors"))


@requires_vllm
def test_run_generate_eager_reports_rates_tokens_and_priority(tiny_model):
    result = engine_run.run_generate(
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


VLLM_STOPS_ON = "All providers in priority must be registered implementations"


@requires_vllm
def test_run_generate_reports_a_failed_engine(tiny_model):
    """A typo in a provider's name: vLLM stops in an assertion that names
    nothing, and the provider's line before it names the culprit."""
    result = engine_run.run_generate(
        tiny_model,
        ir_op_priority={"rms_norm": ["vllm_c_cup", "native"]},
        compiled=False,
        max_tokens=2,
        timeout=600,
        grep=(VLLM_STOPS_ON, "vllm-patch: ir_op_priority"),
    )
    assert not result["ok"]
    assert result["error"]
    assert result["tokens_per_s"] == []
    says = [line for line in result["log_lines"] if "vllm-patch:" in line]
    stops = [line for line in result["log_lines"] if "vllm-patch:" not in line]
    assert says and any(f"AssertionError: {VLLM_STOPS_ON}" in line for line in stops)
    for line in says:
        assert "WARNING" in line and "rms_norm names 'vllm_c_cup'" in line


@pytest.fixture
def known_vllm_environ(monkeypatch):
    """This process's environment without the ``VLLM_*`` variables vLLM does not
    know (a developer's own), so that vLLM's strict environment validation judges
    only what the test sets."""
    from vllm import envs

    for name in list(os.environ):
        if name.startswith("VLLM_") and name not in envs.environment_variables:
            monkeypatch.delenv(name)


OLD_OPT_IN = "VLLM_PATCH_CPU_FUSED_NORMS"  # the name before it left vLLM's namespace

STRICT_START = [
    # (case, variable set to 1, error expected)
    ("the opt-in variable", provider.OPT_IN_ENV, None),
    (
        "a VLLM_ name vLLM does not know",
        OLD_OPT_IN,
        "Unknown vLLM environment variable",
    ),
]


@requires_vllm
@pytest.mark.parametrize(
    "variable, error", [c[1:] for c in STRICT_START], ids=[c[0] for c in STRICT_START]
)
def test_engine_starts_under_strict_environment_validation(
    tiny_model, known_vllm_environ, variable, error
):
    """``fail_on_environ_validation`` (``vllm serve --fail-on-environ-validation``)
    refuses any ``VLLM_*`` variable vLLM does not know; the opt-in is not one, and
    it still ranks the provider first."""
    result = engine_run.run_generate(
        tiny_model,
        ir_op_priority=None,
        compiled=False,
        max_tokens=2,
        env={variable: "1"},
        engine_args={"fail_on_environ_validation": True},
        timeout=600,
        grep=("Unknown vLLM environment variable",),
    )
    if error is None:
        assert result["ok"], result["error"] + "\n" + result["log_tail"]
        assert result["log_lines"] == []  # not refused, not warned about either
        assert f"rms_norm=['{provider.PROVIDER}', 'native']" in result["final_priority"]
    else:
        assert not result["ok"]
        assert f"{error} detected: {variable}" in result["error"]


@requires_transformers
def test_a_served_random_llama_brings_a_word_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    model = engine_run.make_random_llama(tmp_path, **TINY, tokenizer=True)
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert tokenizer("w5 w6 w1000")["input_ids"] == [5, 6, 1000]
    assert model != engine_run.make_random_llama(tmp_path, **TINY)  # no tokenizer
