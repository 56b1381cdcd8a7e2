"""Accuracy of the patched vLLM against the base one: where two servers' greedy
tokens first part, and the largest |delta logprob| up to there."""

import dataclasses
import random

from vllm_patch.bench.record import Divergence, PerPrompt, TokenMode, Tokens, record

MAX_TOKENS = 32
PROMPTS = [  # for a real model: short prompts with a clear greedy continuation
    "The capital of France is",
    "Question: What is 12 times 7? Answer:",
    "def fibonacci(n):",
    "The three primary colours are",
    "Water boils at a temperature of",
    "Translate to German: Good morning, how are you?",
    "The largest planet in the solar system is",
    "Once upon a time, in a small village,",
]
RANDOM_NOTE = (
    "The model has random weights: this shows whether the two vLLMs compute the "
    "same tokens and logprobs up to where rounding parts them (near-flat "
    "distributions flip the greedy token early), not the quality of a trained "
    "model's answers: run with `--model PATH` (and `lm_eval` installed) for that."
)


def word_prompts(vocab_size: int) -> list[str]:
    """For a random-weight model (its words are ``w3`` ..): 8 fixed prompts."""
    rng = random.Random(0)
    words = [f"w{rng.randrange(3, vocab_size)}" for _ in range(8 * 16)]
    return [" ".join(words[i : i + 16]) for i in range(0, len(words), 16)]


@record
class Completion:
    """One prompt's greedy ``tokens`` (ids), each one's logprob, and its text."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str | None = None


def compare(base: list[Completion], patched: list[Completion]) -> TokenMode:
    """Where the patched tokens first part from the base's, and the largest
    |delta logprob| up to there (that position included: its context is shared)."""
    parts = []
    parted = []
    for i, (b, p) in enumerate(zip(base, patched, strict=True)):
        pairs = list(zip(b.tokens, p.tokens, strict=False))
        at = next((i for i, (x, y) in enumerate(pairs) if x != y), None)
        shared = len(pairs) if at is None else at + 1
        deltas = zip(b.logprobs[:shared], p.logprobs[:shared], strict=True)
        delta = max((abs(x - y) for x, y in deltas), default=0.0)
        parts.append(PerPrompt(diverges_at=at, max_abs_dlogprob=delta))
        if at is not None:
            parted.append((at, i))
    first = min(parted, default=None)
    return TokenMode(
        identical_prompts=len(parts) - len(parted),
        first_divergence=first and Divergence(prompt=first[1], position=first[0]),
        max_abs_dlogprob=max((d.max_abs_dlogprob for d in parts), default=0.0),
        per_prompt=tuple(parts),
        base=tuple(b.tokens for b in base),
        patched=tuple(p.tokens for p in patched),
    )


def with_mode(tokens: Tokens, mode: str, compared: TokenMode) -> Tokens:
    """``tokens`` with ``mode`` compared, and over every mode compared: the
    earliest divergence and the largest delta."""
    configs = {**tokens.configs, mode: compared}
    parted = [(m, f.first_divergence) for m, f in configs.items()]
    first = min(((d.position, d.prompt, m) for m, d in parted if d), default=None)
    earliest = None
    if first is not None:
        earliest = Divergence(mode=first[2], prompt=first[1], position=first[0])
    return dataclasses.replace(
        tokens,
        configs=configs,
        first_divergence=earliest,
        max_abs_dlogprob=max(f.max_abs_dlogprob for f in configs.values()),
    )
