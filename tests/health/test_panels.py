"""The report's health panels: downsampling of long curves, the guard's bounds computed as the guard does, and the
figures drawing those bounds and the rollback and stop markers (only for metrics the run recorded)."""

import math

import pytest

from slime_search.health.panels import (
    HEALTH_PANELS,
    downsample,
    draw_panel,
    entropy_bounds,
    length_bounds,
    plot_panels,
    refusal_bound,
    series,
    starting_value,
)

CONFIG = {
    "enabled": True,
    "entropy_low": 0.1,
    "entropy_high": 3.0,
    "max_logprob_gap": 0.1,
    "max_is_capped_share": 0.2,
    "length_blowup": 2.5,
    "truncation_rise": 0.3,
    "grad_spike": 10.0,
    "window": 10,
}
EVENTS = [
    {"step": 6, "action": "rollback", "rule": "reward_drop", "message": "step 6: reward fell", "values": {}},
    {"step": 6, "action": "rollback", "rule": "reward_drop", "message": "back", "values": {"to_step": 2.0}},
    {"step": 9, "action": "stop", "rule": "reward_drop", "message": "step 9: no rollback left", "values": {}},
]


@pytest.fixture(scope="module")
def plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def step(n, **metrics):
    return {"step": n, "time/step_s": 1.0, **metrics}


def panel(name):
    return next(p for p in HEALTH_PANELS if p.file == name)


def lines_by_label(fig):
    return {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}


def test_a_long_curve_keeps_at_most_max_points_its_ends_and_a_one_step_spike():
    steps = list(range(5000))
    values = [1.0] * 5000
    values[2345] = 100.0
    shown = downsample(steps, values, max_points=500)
    assert len(shown.steps) == len(shown.means) == len(shown.lows) == len(shown.highs) == 500
    assert shown.steps[0] == 0 and shown.steps[-1] == 4999
    assert max(shown.highs) == 100.0  # the spike is in its bucket's max
    assert min(shown.lows) == 1.0
    spike_bucket = shown.highs.index(100.0)
    assert shown.steps[spike_bucket - 1] < 2345 < shown.steps[spike_bucket + 1]
    # 4998 interior points in 498 buckets of ~10: the spike's bucket mean is diluted, the others stay 1.0
    assert 1.0 < shown.means[spike_bucket] < 100.0
    assert all(m == 1.0 for i, m in enumerate(shown.means) if i != spike_bucket)


def test_a_short_curve_is_drawn_as_it_is():
    shown = downsample([0, 1, 2], [3.0, 4.0, 5.0])
    assert shown.steps == [0, 1, 2] and shown.means == shown.lows == shown.highs == [3.0, 4.0, 5.0]


def test_series_leaves_out_missing_and_non_finite_values():
    records = [step(0, x=1.0), step(1), step(2, x=math.inf), step(3, x=2), {"step": 4, "x": True}]
    assert series(records, "x") == ([0, 3], [1.0, 2.0])


def test_the_entropy_bounds_are_multiples_of_its_value_at_the_first_step():
    assert starting_value([], "train/entropy") is None and entropy_bounds(CONFIG, []) == []
    records = [step(0, **{"train/entropy": 0.8}), step(1, **{"train/entropy": 0.4}), step(2, **{"train/entropy": 0.05})]
    bounds = entropy_bounds(CONFIG, records)  # start = 0.8, the policy the run started from
    assert [b.value for b in bounds] == pytest.approx([0.08, 2.4])


def test_the_length_bound_moves_with_the_recent_median_and_the_truncation_bound_sits_on_the_right_axis():
    from slime_search.health.panels import moving_bound

    records = [
        step(n, **{"rollout/response_length_p90": p90, "rollout/truncation_rate": rate})
        for n, (p90, rate) in enumerate([(100.0, 0.0), (300.0, 0.2), (200.0, 0.1), (400.0, 0.1)])
    ]
    [truncation] = length_bounds(CONFIG, records)
    assert truncation.value == pytest.approx(0.0 + 0.3) and truncation.right  # the starting rate + the allowed rise
    # step 3: 2.5 x the median of the three steps before it (200)
    assert moving_bound(records, "rollout/response_length_p90", 2.5, 10) == ([3], [500.0])


def test_the_refusal_bound_is_the_spike_factor_times_the_median_of_recent_applied_norms():
    norms = [1.0, 3.0, 2.0, 50.0, 4.0]
    records = [step(n, **{"train/grad_norm": g, "train/steps_applied": 1.0}) for n, g in enumerate(norms)]
    records[3]["train/steps_applied"] = 0.0  # refused: it does not move the bound
    steps, values = refusal_bound(records, spike=10.0, window=10)
    # step 3: median(1, 3, 2) = 2 -> 20; step 4: the refused 50 left out -> still 20
    assert steps == [3, 4] and values == [20.0, 20.0]
    steps, values = refusal_bound(records, spike=10.0, window=3)
    assert steps == [3] and values == [20.0]  # at step 4 the window holds steps 1..3, two of them applied


def test_the_entropy_panel_draws_the_guards_bounds_and_the_rollback_and_stop_markers(plt):
    records = [step(n, **{"train/entropy": 1.0 - 0.05 * n}) for n in range(10)]
    fig = draw_panel(plt, panel("health_entropy.png"), records, EVENTS, CONFIG)
    lines = lines_by_label(fig)
    start = 1.0  # the first step's
    assert lines["collapse (0.1 x start)"].get_ydata()[0] == pytest.approx(0.1 * start)
    assert lines["explosion (3 x start)"].get_ydata()[0] == pytest.approx(3.0 * start)
    assert list(lines["rollback"].get_xdata()) == [6, 6]
    assert list(lines["stop"].get_xdata()) == [9, 9]
    plt.close(fig)
    fig = draw_panel(plt, panel("health_entropy.png"), records, [], None)  # no config: no bound lines
    assert set(lines_by_label(fig)) == {"entropy"}
    plt.close(fig)


def test_the_grad_norm_panel_is_logarithmic_and_marks_refused_updates(plt):
    records = [
        step(n, **{"train/grad_norm": 1.0, "train/grad_norm_max": 1.0, "train/steps": 1.0, "train/steps_applied": 1.0})
        for n in range(6)
    ]
    records[4].update({"train/grad_norm_max": 80.0, "train/steps_applied": 0.0})
    fig = draw_panel(plt, panel("health_grad_norm.png"), records, [], CONFIG)
    assert fig.axes[0].get_yscale() == "log"
    lines = lines_by_label(fig)
    assert list(lines["refused update"].get_xdata()) == [4] and list(lines["refused update"].get_ydata()) == [80.0]
    assert set(lines["refusal bound (10 x median)"].get_ydata()) == {10.0}
    plt.close(fig)


def test_only_panels_with_recorded_metrics_are_written(tmp_path):
    records = [step(n, **{"train/entropy": 1.0, "rollout/truncation_rate": 0.1}) for n in range(4)]
    written = plot_panels(HEALTH_PANELS, records, EVENTS, CONFIG, tmp_path)
    assert written == ["health_entropy.png", "health_length.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == written
    assert (tmp_path / "health_length.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_truncation_bound_is_drawn_only_beside_a_recorded_truncation_rate(plt):
    lengths = [step(n, **{"rollout/response_length_p90": 100.0}) for n in range(4)]
    fig = draw_panel(plt, panel("health_length.png"), lengths, [], CONFIG)
    assert len(fig.axes) == 1 and set(lines_by_label(fig)) == {"p90", "blow-up (2.5 x recent median p90)"}
    plt.close(fig)
    for record in lengths:
        record["rollout/truncation_rate"] = 0.1
    fig = draw_panel(plt, panel("health_length.png"), lengths, [], CONFIG)
    right_lines = {line.get_label(): line for line in fig.axes[1].get_lines()}
    assert right_lines["truncation (start + 0.3)"].get_ydata()[0] == pytest.approx(0.4)
    plt.close(fig)


def test_the_importance_panel_shows_what_mis_took_out_of_the_loss_when_mis_is_on(plt):
    tis = [step(n, **{"health/is_capped_share": 0.01, "train/tis_weight_mean": 1.0}) for n in range(4)]
    fig = draw_panel(plt, panel("health_importance.png"), tis, [], CONFIG)
    assert set(lines_by_label(fig)) == {"share beyond the cap", "mean TIS weight (capped)", "max capped share 0.2"}
    plt.close(fig)
    mis = [
        step(n, **{"health/is_capped_share": 0.01, "train/mis_masked_share": 0.02 * n, "train/mis_weight_mean": 1.0})
        for n in range(4)
    ]
    fig = draw_panel(plt, panel("health_importance.png"), mis, [], CONFIG)
    lines = lines_by_label(fig)
    assert list(lines["share MIS took out of the loss"].get_ydata()) == pytest.approx([0.0, 0.02, 0.04, 0.06])
    assert "mean MIS weight (applied)" in lines and "mean TIS weight (capped)" not in lines
    plt.close(fig)
