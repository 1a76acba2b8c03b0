"""How sure an evaluation is: bootstrap intervals of a mean score, of the paper's average over sets, and of the
difference between two runs graded on the same questions; and the sample size a target interval width needs.

An interval answers one of two questions, and says which (`Interval.about`):
- POPULATION: what would a policy score on questions like these, drawn from where the set was drawn? The questions
  are a sample; every set, whole or subset, gets the plain bootstrap, so more questions give a narrower interval.
- SET: what does it score on this very set? A subset of N questions estimates it, narrowed by the finite-population
  factor; the whole set knows it exactly (a zero-width interval).

Pure functions of per-question scores (EM or F1 in [0, 1], one per question). The percentile bootstrap resamples
questions with replacement; the average over sets (Search-R1's "Avg.", each set weighing the same) resamples each set
on its own, so its interval is that of the sum of independent set means. A paired comparison resamples the shared
questions once for both runs, so the questions' own difficulty cancels out of the difference.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95
Z_95 = 1.959963984540054
POPULATION = "population"  # about the population of questions the set was drawn from
SET = "set"  # about this set's own score (for a subset: the whole set's)
MAX_DISTINCT = 1024  # scores with at most this many distinct values: multinomial counts, else index chunks
CHUNK_ELEMENTS = 1 << 22  # resampled indices held at once otherwise (32 MiB of int64)


@dataclass(frozen=True)
class Interval:
    """A mean and its two-sided interval at `level`."""

    mean: float
    low: float
    high: float
    n: int
    level: float = LEVEL
    about: str = POPULATION

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def as_dict(self) -> dict:
        return {
            "mean": self.mean,
            "low": self.low,
            "high": self.high,
            "n": self.n,
            "level": self.level,
            "about": self.about,
        }


def _percentiles(draws: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(draws, [tail, 100 - tail])
    return float(low), float(high)


def finite_population_factor(n: int, population: int | None) -> float:
    """How much narrower the spread of a mean is when its `n` questions are drawn without replacement from a set of
    `population`: sqrt((N - n) / (N - 1)), and 1 without a population.

    The subset's interval is then about that set's EM."""
    if population is None or population <= 1:
        return 1.0
    if n > population:
        raise ValueError(f"{n} questions cannot be drawn from a set of {population}")
    return math.sqrt((population - n) / (population - 1))


def _resampled_means(values: np.ndarray, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """The means of `resamples` bootstrap resamples of `values`.

    A resample's mean depends only on how often it draws each distinct score, and those counts are multinomial. So for
    scores with few distinct values (0/1 grades, paired differences in {-1, 0, 1}, token F1 of short answers) the counts
    are drawn directly. That is exactly the distribution that resampling question indices gives. It costs memory and
    time of resamples x distinct values instead of resamples x questions. Other scores are resampled by index in chunks
    of bounded size."""
    n = len(values)
    distinct, counts = np.unique(values, return_counts=True)
    if len(distinct) <= MAX_DISTINCT:
        drawn = rng.multinomial(n, counts / n, size=resamples)  # resamples x distinct
        return drawn @ distinct / n
    rows = max(1, CHUNK_ELEMENTS // n)
    chunks = range(0, resamples, rows)
    return np.concatenate([values[rng.integers(0, n, size=(min(rows, resamples - c), n))].mean(axis=1) for c in chunks])


@dataclass(frozen=True)
class Draws:
    """A set's scores and the means of their bootstrap resamples, drawn once.

    The set's interval about the population of questions, its interval about the set itself, and its share of an
    average over sets all read the same draws."""

    values: np.ndarray
    means: np.ndarray

    @classmethod
    def of(cls, values, seed: int = 0, resamples: int = RESAMPLES, stream: str = "") -> Draws:
        """Resampled under `seed`; `stream` (a set's name) gives each set a random stream of its own, so that sets
        resampled under one seed are independent of each other."""
        values = np.asarray(values, dtype=np.float64)
        if values.size == 0:
            raise ValueError("no scores: an interval needs at least one question")
        rng = np.random.default_rng([seed, zlib.crc32(stream.encode())] if stream else seed)
        return cls(values, _resampled_means(values, rng, resamples))

    @property
    def mean(self) -> float:
        return float(self.values.mean())

    def spread(self, population: int | None = None) -> np.ndarray:
        """The draws about the population of questions, or about the set's own mean given its size.

        `population` is the size of the set the scores were drawn from. About that set the draws are narrower by the
        finite-population factor, and a whole set's draws are exactly its mean."""
        if population is None:
            return self.means
        return self.mean + (self.means - self.mean) * finite_population_factor(self.values.size, population)

    def interval(self, level: float = LEVEL, population: int | None = None) -> Interval:
        about = POPULATION if population is None else SET
        low, high = _percentiles(self.spread(population), level)
        return Interval(self.mean, low, high, n=int(self.values.size), level=level, about=about)


def bootstrap_interval(
    values, seed: int = 0, resamples: int = RESAMPLES, level: float = LEVEL, population: int | None = None
) -> Interval:
    """The mean of `values` and its percentile-bootstrap interval: about the population the questions come from
    (POPULATION), or, given the size `population` of the set they were drawn from, about that set's own mean (SET;
    zero-width when the values are the whole set)."""
    return Draws.of(values, seed, resamples).interval(level, population)


def average_interval(
    draws_by_set: dict[str, Draws], level: float = LEVEL, populations: dict[str, int] | None = None
) -> Interval:
    """The unweighted average of the sets' means (the paper's Avg.) and its interval from each set's own draws. The
    interval is about the population of questions. Given every set's size in `populations`, it is about the sets' own
    scores instead (each set narrowed as a subset of its set; a whole set adds no spread)."""
    if not draws_by_set:
        raise ValueError("every set needs at least one question")
    sizes = populations or {}
    spread = np.mean([draws.spread(sizes.get(name)) for name, draws in draws_by_set.items()], axis=0)
    mean = float(np.mean([draws.mean for draws in draws_by_set.values()]))
    about = POPULATION if populations is None else SET
    n = sum(draws.values.size for draws in draws_by_set.values())
    return Interval(mean, *_percentiles(spread, level), n=n, level=level, about=about)


def average_over_sets_interval(
    values_by_set: dict[str, list[float]],
    seed: int = 0,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    populations: dict[str, int] | None = None,
) -> Interval:
    """`average_interval` of the sets' scores, each set resampled on its own stream."""
    if not values_by_set or any(len(v) == 0 for v in values_by_set.values()):
        raise ValueError("every set needs at least one question")
    draws = {name: Draws.of(values, seed, resamples, name) for name, values in values_by_set.items()}
    return average_interval(draws, level, populations)


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
    """How many questions make the 95% interval of a mean of 0/1 scores at most `width` wide.

    The count is a normal approximation at the expected score, 0.5 being the widest. Given `population`, the
    questions are drawn without replacement from a set of that many."""
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
