"""Whether a held-out evaluation really fell below the best one: the test the guard's held-out rules apply.

The best of K noisy evaluations is high by chance (the winner's curse): comparing it with one later evaluation as two
independent estimates fires on flat runs far more often than the nominal rate. Both versions graded the same
questions, so the comparison is paired, per question: d_i = best_i - current_i. Its mean is the drop. Its spread is
that of the disagreements only: questions both versions get right or wrong add nothing. The best was chosen among K
evaluations, so the one-sided level alpha is split among them (Bonferroni). The drop counts when

    mean(d) - z(1 - alpha / K) * sd(d) / sqrt(n) > 0

A pure function of two lists of grades; without grades for both versions (an older record, a changed question set)
the rule falls back to the point estimates and its margin alone.
"""

from __future__ import annotations

import math
from statistics import NormalDist

ALPHA = 0.05  # one-sided, over all the evaluations the best was chosen from


def paired_drop_lower_bound(best: list[float], current: list[float], comparisons: int, alpha: float = ALPHA) -> float:
    """The lower confidence bound of mean(best - current) per question, at one-sided level alpha / comparisons."""
    if len(best) != len(current) or len(best) < 2:
        raise ValueError(f"paired grades need the same questions, at least 2: got {len(best)} and {len(current)}")
    n = len(best)
    diffs = [b - c for b, c in zip(best, current, strict=True)]
    mean = sum(diffs) / n
    variance = sum((d - mean) ** 2 for d in diffs) / (n - 1)
    z = NormalDist().inv_cdf(1 - alpha / max(1, comparisons))
    return mean - z * math.sqrt(variance / n)


def paired_drop_is_real(best: list[float] | None, current: list[float] | None, comparisons: int) -> bool | None:
    """Whether the drop from `best` to `current` is beyond chance; None when the two cannot be paired."""
    if best is None or current is None or len(best) != len(current) or len(best) < 2:
        return None
    return paired_drop_lower_bound(best, current, comparisons) > 0
