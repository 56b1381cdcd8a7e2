"""vllm_patch.bench.random_models: the random Llama, made locally."""

from __future__ import annotations

import importlib.util

import pytest

from vllm_patch.bench import random_models

TINY = random_models.TINY_LLAMA

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("torch") is None,
    reason="transformers or torch is absent",
)


def test_random_llama_is_cached_by_config(tmp_path):
    first = random_models.make_random_llama(tmp_path, **TINY)
    stamp = (first / "config.json").stat().st_mtime_ns
    again = random_models.make_random_llama(tmp_path, **TINY)
    other = random_models.make_random_llama(tmp_path, **{**TINY, "seed": 1})
    assert again == first
    assert (again / "config.json").stat().st_mtime_ns == stamp
    assert other != first


def test_a_served_random_llama_brings_a_word_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    model = random_models.make_random_llama(tmp_path, **TINY, tokenizer=True)
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert tokenizer("w5 w6 w1000")["input_ids"] == [5, 6, 1000]
    assert model != random_models.make_random_llama(
        tmp_path, **TINY
    )  # no tokenizer
