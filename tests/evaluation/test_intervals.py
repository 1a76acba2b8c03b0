"""Bootstrap intervals, paired differences, sample sizes and fixed subsets."""

import math
import random

import numpy as np
import pytest

from slime_search.evaluation.intervals import (
    Z_95,
    average_over_sets_interval,
    bootstrap_interval,
    paired_difference,
    questions_for_width,
)


def test_the_interval_of_a_proportion_is_close_to_the_normal_one_and_holds_the_mean():
    values = [1.0] * 300 + [0.0] * 700
    interval = bootstrap_interval(values, seed=3)
    assert interval.mean == pytest.approx(0.3) and interval.n == 1000
    assert interval.low < 0.3 < interval.high
    normal = Z_95 * math.sqrt(0.3 * 0.7 / 1000)
    assert interval.half_width == pytest.approx(normal, rel=0.1)


def test_the_same_seed_gives_the_same_interval_and_no_scores_is_an_error():
    values = np.random.default_rng(0).random(50)
    assert bootstrap_interval(values, seed=1) == bootstrap_interval(values, seed=1)
    with pytest.raises(ValueError, match="at least one question"):
        bootstrap_interval([])


def test_intervals_cover_the_true_mean_about_95_percent_of_the_time():
    """200 samples of 200 Bernoulli(0.4) draws: the 95% interval holds 0.4 in 93-97% of them (binomial noise of
    200 trials at 0.95 is 1.5 points)."""
    rng = np.random.default_rng(11)
    hits = sum(
        (lambda i: i.low <= 0.4 <= i.high)(bootstrap_interval(rng.random(200) < 0.4, seed=k, resamples=1000))
        for k in range(200)
    )
    assert 0.91 <= hits / 200 <= 0.985


def test_the_average_over_sets_weighs_each_set_the_same():
    sets = {"nq": [1.0] * 90 + [0.0] * 10, "bamboogle": [0.0] * 10 + [1.0] * 0}
    interval = average_over_sets_interval(sets, seed=0)
    assert interval.mean == pytest.approx((0.9 + 0.0) / 2) and interval.n == 110
    assert interval.low <= 0.45 <= interval.high
    with pytest.raises(ValueError, match="at least one question"):
        average_over_sets_interval({"nq": []})


def test_a_paired_difference_finds_what_an_unpaired_one_would_call_noise():
    """B fails one in twenty of the questions A gets right: the pairing sees the difference although the two runs'
    own intervals overlap."""
    rng = random.Random(5)
    a = [float(rng.random() < 0.5) for _ in range(400)]
    b = [0.0 if x and rng.random() < 0.05 else x for x in a]
    result = paired_difference(a, b, seed=0)
    assert result.verdict == "A is better" and result.difference.low > 0
    assert bootstrap_interval(a).low < bootstrap_interval(b).high  # unpaired, the intervals overlap
    assert paired_difference(b, a).verdict == "B is better"
    assert paired_difference(a, a).verdict == "within noise"
    with pytest.raises(ValueError, match="same questions"):
        paired_difference(a, b[:-1])


def test_questions_for_a_width_follow_the_normal_approximation():
    assert questions_for_width(0.1) == 385  # 1.96^2 * 0.25 / 0.05^2
    assert questions_for_width(0.1, expected=0.2) == 246
    assert questions_for_width(0.1, population=125) < 125  # Bamboogle: most of the set
    assert questions_for_width(0.01, population=125) == 125
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="width"):
            questions_for_width(bad)


def test_the_size_for_a_width_gives_that_width_when_measured():
    n = questions_for_width(0.08, expected=0.4)
    values = np.random.default_rng(2).random(n) < 0.4
    assert bootstrap_interval(values, seed=0).high - bootstrap_interval(values, seed=0).low == pytest.approx(
        0.08, rel=0.1
    )


def test_a_subsets_interval_is_about_its_whole_set_and_narrows_with_the_share_drawn():
    from slime_search.evaluation.intervals import finite_population_factor

    values = np.random.default_rng(4).random(400) < 0.3
    free = bootstrap_interval(values, seed=0)
    of_1000 = bootstrap_interval(values, seed=0, population=1000)
    assert finite_population_factor(400, 1000) == pytest.approx(math.sqrt(600 / 999))
    assert of_1000.half_width == pytest.approx(free.half_width * math.sqrt(600 / 999), rel=0.02)
    whole = bootstrap_interval(values, seed=0, population=400)  # the whole set: its EM is known exactly
    assert whole.low == whole.high == pytest.approx(whole.mean)
    assert finite_population_factor(10, None) == 1.0
    with pytest.raises(ValueError, match="cannot be drawn"):
        finite_population_factor(11, 10)


def test_subset_intervals_cover_the_whole_sets_score_about_95_percent_of_the_time():
    """Draws of 300 of a set of 600 (the miniature's held-out size): the narrowed interval holds the set's own EM
    93-97% of the time (+-1.5 points of binomial noise over 400 draws); the unnarrowed one would over-cover."""
    from slime_search.evaluation.subsets import fixed_subset

    population = (np.random.default_rng(8).random(600) < 0.45).astype(float)
    truth = population.mean()
    held = held_unnarrowed = 0
    for draw in range(400):
        subset = population[fixed_subset(600, 300, draw, "heldout")]
        interval = bootstrap_interval(subset, seed=draw, resamples=500, population=600)
        wide = bootstrap_interval(subset, seed=draw, resamples=500)
        held += interval.low <= truth <= interval.high
        held_unnarrowed += wide.low <= truth <= wide.high
    assert 0.92 <= held / 400 <= 0.98
    assert held_unnarrowed / 400 > 0.98
