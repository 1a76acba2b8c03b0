"""How sure an evaluation is: bootstrap intervals of a mean score, of the paper's average over sets, and of the
difference between two runs graded on the same questions; and the sample size a target interval width needs.

Pure functions of per-question scores (EM or F1 in [0, 1], one per question). The percentile bootstrap resamples
questions with replacement; the average over sets (Search-R1's "Avg.", each set weighing the same) resamples each set
on its own, so its interval is that of the sum of independent set means. A paired comparison resamples the shared
questions once for both runs, so the questions' own difficulty cancels out of the difference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95
Z_95 = 1.959963984540054


@dataclass(frozen=True)
class Interval:
    """A mean and its two-sided interval at `level`."""

    mean: float
    low: float
    high: float
    n: int
    level: float = LEVEL

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def as_dict(self) -> dict:
        return {"mean": self.mean, "low": self.low, "high": self.high, "n": self.n, "level": self.level}


def _percentiles(draws: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(draws, [tail, 100 - tail])
    return float(low), float(high)


def finite_population_factor(n: int, population: int | None) -> float:
    """How much narrower the spread of a mean is when its `n` questions are drawn without replacement from a set of
    `population` (the subset's interval is about that set's EM): sqrt((N - n) / (N - 1)); 1 without a population."""
    if population is None or population <= 1:
        return 1.0
    if n > population:
        raise ValueError(f"{n} questions cannot be drawn from a set of {population}")
    return math.sqrt((population - n) / (population - 1))


def _resampled_means(
    values: np.ndarray, rng: np.random.Generator, resamples: int, population: int | None = None
) -> np.ndarray:
    """Bootstrap means, their spread around the mean narrowed for a subset of a finite set."""
    picks = rng.integers(0, len(values), size=(resamples, len(values)))
    means = values[picks].mean(axis=1)
    return values.mean() + (means - values.mean()) * finite_population_factor(len(values), population)


def bootstrap_interval(
    values, seed: int = 0, resamples: int = RESAMPLES, level: float = LEVEL, population: int | None = None
) -> Interval:
    """The mean of `values` and its percentile-bootstrap interval: of the mean of the distribution the questions
    come from, or, given the `population` of the set a subset was drawn from, of that whole set's mean."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        raise ValueError("no scores: an interval needs at least one question")
    means = _resampled_means(values, np.random.default_rng(seed), resamples, population)
    return Interval(float(values.mean()), *_percentiles(means, level), n=int(values.size), level=level)


def average_over_sets_interval(
    values_by_set: dict[str, list[float]],
    seed: int = 0,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    populations: dict[str, int] | None = None,
) -> Interval:
    """The unweighted average of the sets' means (the paper's Avg.) and its interval, each set resampled on its own
    (and narrowed as a subset of its set where `populations` gives the set's size)."""
    if not values_by_set or any(len(v) == 0 for v in values_by_set.values()):
        raise ValueError("every set needs at least one question")
    rng = np.random.default_rng(seed)
    names = sorted(values_by_set)
    arrays = [np.asarray(values_by_set[name], dtype=np.float64) for name in names]
    sizes = [(populations or {}).get(name) for name in names]
    draws = np.mean([_resampled_means(v, rng, resamples, size) for v, size in zip(arrays, sizes, strict=True)], axis=0)
    mean = float(np.mean([values.mean() for values in arrays]))
    return Interval(mean, *_percentiles(draws, level), n=sum(v.size for v in arrays), level=level)


@dataclass(frozen=True)
class Difference:
    """Run A's mean minus run B's on the same questions, its paired interval and what it means."""

    difference: Interval
    a_mean: float
    b_mean: float

    @property
    def verdict(self) -> str:
        if self.difference.low > 0:
            return "A is better"
        if self.difference.high < 0:
            return "B is better"
        return "within noise"

    def as_dict(self) -> dict:
        return {**self.difference.as_dict(), "a": self.a_mean, "b": self.b_mean, "verdict": self.verdict}


def paired_difference(
    a, b, seed: int = 0, resamples: int = RESAMPLES, level: float = LEVEL, population: int | None = None
) -> Difference:
    """A - B over the same questions in the same order, with the paired-bootstrap interval (of the whole set's
    difference, given the `population` of the set the questions are a subset of)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"a paired comparison needs the same questions in both runs: {a.size} vs {b.size}")
    interval = bootstrap_interval(a - b, seed, resamples, level, population)
    return Difference(interval, float(a.mean()), float(b.mean()))


def questions_for_width(width: float, population: int | None = None, expected: float = 0.5) -> int:
    """How many questions make the 95% interval of a mean of 0/1 scores at most `width` wide (normal
    approximation at the expected score, 0.5 being the widest), drawn without replacement from a set of
    `population` questions when given."""
    if not 0 < width < 1:
        raise ValueError(f"the interval width must lie in (0, 1): {width}")
    if not 0 <= expected <= 1:
        raise ValueError(f"the expected score must lie in [0, 1]: {expected}")
    half = width / 2
    n = math.ceil(Z_95**2 * max(expected * (1 - expected), 1e-4) / half**2)
    if population is not None:  # a sample that is a large share of its set knows that set better
        n = math.ceil(n / (1 + (n - 1) / population))
        n = min(n, population)
    return max(n, 1)
