"""Paired figures and their bootstrap intervals. A repetition's figures share
the load of the moment, so a ratio is the trimmed mean of per-repetition log
ratios (one busy repetition moves it little), its interval a seeded percentile
bootstrap of the same estimator."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

TRIM = 0.1  # the share of the repetitions left out at each end
RESAMPLES = 2000
Figures = Sequence[float | None]


def trimmed_mean(values: Sequence[float]) -> float:
    ordered = sorted(values)
    cut = int(len(ordered) * TRIM)
    kept = ordered[cut : len(ordered) - cut] or ordered
    return sum(kept) / len(kept)


def bootstrap(values: Sequence[float]) -> tuple[float, float, float]:
    """(trimmed mean, low, high): a seeded 95 % percentile bootstrap."""
    if not values:
        raise ValueError("no values to estimate from")
    rng = random.Random(0)
    k = len(values)
    found = sorted(trimmed_mean(rng.choices(values, k=k)) for _ in range(RESAMPLES))
    low, high = (found[int(q * (RESAMPLES - 1))] for q in (0.025, 0.975))
    return trimmed_mean(values), low, high


def level(values: Figures, key: str = "ms", back=float) -> dict[str, object]:
    """A level: ``key`` (the trimmed mean), ``ci95``, ``n``, mapped by ``back``."""
    kept = [v for v in values if v is not None]
    mid, lo, hi = (round(back(v), 4) for v in bootstrap(kept))
    return {key: mid, "ci95": [lo, hi], "n": len(kept)}


def ratio(numerator: Figures, denominator: Figures) -> dict[str, object]:
    """numerator / denominator where both are positive: ``ratio``, ``ci95``, ``n``."""
    pairs = zip(numerator, denominator, strict=True)
    logs = [math.log(a / b) for a, b in pairs if (a or 0) > 0 and (b or 0) > 0]
    return level(logs, "ratio", math.exp)


def difference(first: Figures, second: Figures) -> dict[str, object]:
    """The :func:`level` of first - second per repetition (both present)."""
    pairs = zip(first, second, strict=True)
    return level([a - b for a, b in pairs if None not in (a, b)])
