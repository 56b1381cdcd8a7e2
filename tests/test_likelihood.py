"""The paired log-likelihood and greedy agreement: statistics and text in the
fast tier (literal cases), one real engine on SmolLM2 in the integration tier."""

import hashlib
import json
import math

import pytest

from vllm_patch.bench import likelihood, record
from vllm_patch.bench.record import Interval


@pytest.mark.parametrize(
    ("side", "base", "tokens", "expected"),
    [
        # the same nats on both sides: exactly 0, an interval of width 0
        ([10.0, 20.0, 30.0], [10.0, 20.0, 30.0], [5, 5, 5], (0.0, 0.0, 0.0)),
        # every chunk 0.5 nats a token worse: 0.5, whatever is resampled
        ([3.0, 5.5], [2.0, 4.0], [2, 3], (0.5, 0.5, 0.5)),
        # two chunks, 0 and 2 a token: 1 in all; a quarter of the resamples
        # pick the first twice (0), a quarter the second twice (2)
        ([1.0, 3.0], [1.0, 1.0], [1, 1], (1.0, 0.0, 2.0)),
        # a sum over tokens, not a mean of chunk means: (0 + 4) / (1 + 3)
        ([1.0, 5.0], [1.0, 1.0], [1, 3], (1.0, 0.0, 4 / 3)),
    ],
)
def test_the_difference_is_per_token_with_a_bootstrap_over_chunks(
    side, base, tokens, expected
):
    found = likelihood.per_token_difference(side, base, tokens)
    assert (found.mean, found.low, found.high) == pytest.approx(expected)
    assert found.n == len(side)


def test_a_difference_needs_a_figure_per_chunk_on_each_side():
    with pytest.raises(ValueError):
        likelihood.per_token_difference([1.0], [1.0, 2.0], [1])
    with pytest.raises(ValueError):
        likelihood.per_token_difference([], [], [])


def test_the_interval_holds_the_mean_and_narrows_with_more_chunks():
    noise = [math.sin(i) for i in range(64)]
    few = likelihood.per_token_difference(noise[:8], [0.0] * 8, [1] * 8)
    many = likelihood.per_token_difference(noise, [0.0] * 64, [1] * 64)
    for found in (few, many):
        assert found.low <= found.mean <= found.high
    assert many.high - many.low < few.high - few.low


@pytest.mark.parametrize(
    ("base", "other", "expected"),
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([], [], None),
        ([1, 2, 3], [1, 5, 3], 1),
        ([4], [5], 0),
        ([1, 2], [1, 2, 3], 2),  # one answer ended where the other went on
        ([1, 2, 3], [1], 1),
    ],
)
def test_first_divergence_is_the_first_index_that_differs(base, other, expected):
    assert likelihood.first_divergence(base, other) == expected


@pytest.mark.parametrize(
    ("ids", "size", "expected"),
    [
        (list(range(7)), 3, [[0, 1, 2], [3, 4, 5]]),
        (list(range(6)), 3, [[0, 1, 2], [3, 4, 5]]),
        (list(range(2)), 3, []),
    ],
)
def test_only_whole_chunks_are_scored(ids, size, expected):
    assert likelihood.chunks(ids, size) == expected


def test_the_text_is_the_shipped_licence_texts_as_pinned():
    text = likelihood.text()
    assert text.lstrip().startswith("GNU GENERAL PUBLIC LICENSE\n")
    assert "Version 3, 29 June 2007" in text and "Version 2, June 1991" in text
    assert len(text) > 50_000  # about 11,700 SmolLM2 tokens


def test_a_changed_text_is_refused(monkeypatch):
    changed = dict(
        likelihood.TEXTS, **{"gpl-2.0.txt": hashlib.sha256().hexdigest()}
    )
    monkeypatch.setattr(likelihood, "TEXTS", changed)
    with pytest.raises(ValueError, match="gpl-2.0.txt is not the pinned text"):
        likelihood.text()


def engine(nats, greedy, loaded=("_C_AVX2",)):
    """What :func:`likelihood.score` returns, written out."""
    return {
        "nats": nats,
        "tokens": [4] * len(nats),
        "greedy": greedy,
        "answers": [f"answer {i}" for i in range(len(greedy))],
        "loaded": list(loaded),
        "threads": 1,
        "norm_classes": ["RMSNorm"],
        "seconds": 60.0,
    }


GOT = {
    "base": engine([8.0, 12.0], [[1, 2, 3], [4, 5]]),
    "patched": engine([8.0, 12.0], [[1, 2, 3], [4, 5]]),
    "provider": engine([8.4, 12.4], [[1, 9, 3], [4, 5]]),
}
SETTINGS = likelihood.Settings(chunk=5, prompts=("a", "b"), max_tokens=3)


def test_each_side_is_compared_with_the_base_chunk_by_chunk():
    found = likelihood.likelihood_of(GOT, "float32", "_C_AVX2", chunk=5)
    assert found.nats_per_token == {"base": 2.5, "patched": 2.5, "provider": 2.6}
    assert found.difference["patched"] == Interval(0.0, 0.0, 0.0, 2)
    provider = found.difference["provider"]
    assert (provider.mean, provider.low, provider.high) == pytest.approx((0.1,) * 3)
    assert (found.tokens, found.chunk, set(found.difference)) == (
        8,
        5,
        {"patched", "provider"},
    )


def test_greedy_agreement_is_per_prompt_against_the_base():
    found = likelihood.greedy_of(GOT, "float32", "_C_AVX2", SETTINGS)
    assert found.divergence == {"patched": [None, None], "provider": [1, None]}
    assert found.to_json()["identical"] == {"patched": 2, "provider": 1}
    assert (
        likelihood.greedy_shown(found, "provider")
        == "1/2 identical; first differ: #1 at 1"
    )


def test_a_comparison_is_read_back_as_written():
    result = record.Likelihood(
        likelihood.likelihood_of(GOT, "float32", "_C_AVX2", chunk=5),
        likelihood.greedy_of(GOT, "float32", "_C_AVX2", SETTINGS),
        {"base": {"threads": 1}},
    )
    written = json.loads(json.dumps(result.to_json()))
    assert record.Likelihood.from_json(written) == result


def test_the_markdown_shows_each_side_with_its_interval():
    result = record.Likelihood(
        likelihood.likelihood_of(GOT, "float32", "_C_AVX2", chunk=5),
        likelihood.greedy_of(GOT, "float32", "_C_AVX2", SETTINGS),
        {},
    )
    text = "\n".join(likelihood.markdown([result], "Smol*LM"))
    assert "with Smol\\*LM, eager" in text
    assert "| float32 | `_C_AVX2` | base | 2.50000 | (base) | (base) |" in text
    assert "| patched | 2.50000 | 0 (identical) | 2/2 identical |" in text
    assert "| provider | 2.60000 | +1.00e-01 [+1.00e-01, +1.00e-01] | 1/2" in text


# --- the real model through vLLM (integration) ----------------------------------


@pytest.mark.vllm
@pytest.mark.e2e
def test_smollm2_answers_paris_and_scores_the_text():
    """One eager engine (about a minute): greedy and teacher-forced on SmolLM2."""
    from vllm_patch.bench import smollm2

    model = smollm2.ensure_model()
    asked = likelihood.Settings(
        chunk=64, most=2, prompts=("What is the capital of France?",), max_tokens=12
    )
    side = likelihood.Side("base")
    # float32: the same answer on every x86 build. In bfloat16 the 135M model's
    # greedy answer depends on the build's matmuls (on _C with AMX it named
    # "L'Étoile" here, on _C_AVX2 Paris).
    found = likelihood.run_side(model.path, side, "float32", None, asked)
    assert "Paris" in found["answers"][0]
    assert found["tokens"] == [63, 63]
    # a trained model on English prose: a few nats a token (random: ln 49152 = 10.8)
    assert 1.0 < sum(found["nats"]) / sum(found["tokens"]) < 6.0


@pytest.mark.slow
@pytest.mark.vllm
def test_base_patched_and_provider_are_compared_on_a_short_text():
    """Three eager engines (a few minutes): what ``run`` does per dtype, short."""
    from patcher.tree import open_tree
    from vllm_patch.bench import smollm2
    from vllm_patch.runtime.patched_copy import choose_patch, patched_copy

    model = smollm2.ensure_model()
    tree = open_tree(None)
    asked = likelihood.Settings(
        chunk=64, most=4, prompts=likelihood.CHAT_PROMPTS[:3], max_tokens=8
    )
    with patched_copy(tree, choose_patch(tree)) as copy:
        sides = likelihood.sides(str(copy))
        found = likelihood.measure(model.path, sides, "float32", settings=asked)
    assert set(found.likelihood.difference) == {"patched", "provider"}
    for d in found.likelihood.difference.values():
        assert d.low <= d.mean <= d.high and abs(d.mean) < 1e-3 and d.n == 4
    assert found.likelihood.build.startswith("_C")
    assert "Paris" in found.greedy.base_answers[0]
    assert set(found.greedy.divergence) == {"patched", "provider"}
