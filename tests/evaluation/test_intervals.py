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


def index_bootstrap(values, seed, resamples):
    """The textbook bootstrap: resample question indices with replacement, take each resample's mean."""
    rng = np.random.default_rng(seed)
    return values[rng.integers(0, len(values), size=(resamples, len(values)))].mean(axis=1)


@pytest.mark.parametrize(
    "values",
    [
        np.random.default_rng(1).random(500) < 0.3,  # 0/1 grades
        np.random.default_rng(2).choice([-1.0, 0.0, 1.0], size=500, p=[0.1, 0.8, 0.1]),  # paired differences
        np.random.default_rng(3).random(1500),  # distinct F1-like scores: above the multinomial's limit
    ],
    ids=["binary", "paired", "continuous"],
)
def test_the_resampled_means_have_the_distribution_index_resampling_gives(values):
    """Counts drawn per distinct value (or chunked indices) against the index bootstrap, 10,000 resamples each: the
    means' spread agrees with it and with the exact bootstrap standard error sqrt(var / n) to 3%, and the
    percentiles agree to a tenth of the interval's width."""
    from slime_search.evaluation.intervals import _resampled_means

    values = values.astype(np.float64)
    ours = _resampled_means(values, np.random.default_rng(0), 10_000)
    reference = index_bootstrap(values, 1, 10_000)
    exact = values.std() / math.sqrt(values.size)
    assert ours.std() == pytest.approx(exact, rel=0.03) and reference.std() == pytest.approx(exact, rel=0.03)
    assert ours.mean() == pytest.approx(values.mean(), abs=exact / 20)
    for q in (2.5, 97.5):
        assert np.percentile(ours, q) == pytest.approx(np.percentile(reference, q), abs=0.1 * 4 * exact)


@pytest.mark.parametrize("kind", ["binary", "continuous"])
def test_an_intervals_memory_does_not_grow_with_resamples_times_questions(kind):
    """40,000 questions x 2,000 resamples as one index matrix is 640 MB (plus as much again for the scores it
    picks); the interval takes well under 100 MB either way (binary: kilobytes)."""
    import tracemalloc

    rng = np.random.default_rng(0)
    values = (rng.random(40_000) < 0.4).astype(float) if kind == "binary" else rng.random(40_000)
    tracemalloc.start()
    try:
        interval = bootstrap_interval(values, seed=0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < (5 if kind == "binary" else 100) * 2**20, f"{peak / 2**20:.1f} MiB"
    assert interval.low < values.mean() < interval.high


def test_every_interval_says_what_it_is_about():
    values = [1.0, 0.0, 1.0, 1.0]
    assert bootstrap_interval(values).as_dict()["about"] == "population"
    assert bootstrap_interval(values, population=10).about == "set"
    assert average_over_sets_interval({"a": values}).about == "population"
    assert average_over_sets_interval({"a": values}, populations={"a": 4}).about == "set"
    assert paired_difference(values, values[::-1], population=8).difference.about == "set"
