"""The curves of the run report, one PNG per panel.

The health guard's bounds are drawn beside the signals they bound (RUN/health_config.json). A marker stands at every
rollback and at the stop (RUN/health.jsonl). The curves of long runs are downsampled, so that thousands of steps stay
readable.

The health panels show what the guard watches: entropy, the trainer-engine log-prob gap, importance weights, clip
fractions, KL, response length and truncations, the gradient norm and its refused updates, the rollout rates and the
reward's spread. A panel none of whose metrics the run recorded is not drawn.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_search.health.records import (
    MIN_NORMS,
    recent_median,
    spike_baseline_steps,
    starting_value,
    was_applied,
)

MAX_POINTS = 500  # points of a drawn curve: more are averaged in buckets
MARKERS_UP_TO = 60  # points of a curve drawn with a marker on each
# curve colours: orange marks the rollbacks and red the guard's bounds, refusals and the stop
COLORS = ("C0", "C2", "C4", "C5", "C6", "C8", "C9", "C7")


@dataclass(frozen=True)
class Downsampled:
    steps: list[float]
    means: list[float]
    lows: list[float]
    highs: list[float]


def downsample(steps: list[float], values: list[float], max_points: int = MAX_POINTS) -> Downsampled:
    """At most `max_points` points: the first and the last as they are, those between averaged in buckets.

    A bucket holds consecutive points, and its min and max are kept as well. So a one-step spike stays visible in the
    band."""
    if len(steps) <= max_points:
        return Downsampled(list(steps), list(values), list(values), list(values))
    out = Downsampled([steps[0]], [values[0]], [values[0]], [values[0]])
    inner, buckets = len(steps) - 2, max_points - 2
    for bucket in range(buckets):
        start, stop = 1 + bucket * inner // buckets, 1 + (bucket + 1) * inner // buckets
        xs, ys = steps[start:stop], values[start:stop]
        out.steps.append(sum(xs) / len(xs))
        out.means.append(sum(ys) / len(ys))
        out.lows.append(min(ys))
        out.highs.append(max(ys))
    for column, value in zip((out.steps, out.means, out.lows, out.highs), (steps[-1], *[values[-1]] * 3), strict=True):
        column.append(value)
    return out


def number(record: dict[str, Any], key: str) -> float | None:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """The steps and finite values of `key` (a non-finite value cannot be drawn; the events name it)."""
    points = [(r["step"], number(r, key)) for r in records]
    points = [(step, value) for step, value in points if value is not None]
    return [p[0] for p in points], [p[1] for p in points]


# ---- the guard's bounds ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bound:
    value: float
    label: str
    right: bool = False  # on the panel's second axis


Bounds = Callable[[dict[str, Any], list[dict[str, Any]]], list[Bound]]


def entropy_bounds(config: dict[str, Any], records: list[dict[str, Any]]) -> list[Bound]:
    start = starting_value(records, "train/entropy")
    low, high = config.get("entropy_low"), config.get("entropy_high")
    if start is None or low is None or high is None:
        return []
    return [Bound(low * start, f"collapse ({low:g} x start)"), Bound(high * start, f"explosion ({high:g} x start)")]


def fixed_bound(key: str, label: str, right: bool = False) -> Bounds:
    """A bound that is a setting of the guard, as it is."""

    def bounds(config: dict[str, Any], records: list[dict[str, Any]]) -> list[Bound]:
        value = config.get(key)
        return [] if value is None else [Bound(float(value), f"{label} {value:g}", right)]

    return bounds


def length_bounds(config: dict[str, Any], records: list[dict[str, Any]]) -> list[Bound]:
    """The truncation bound (the length blow-up bound moves with the recent median: `draw_length_bound`)."""
    bounds = []
    start_truncated, rise = starting_value(records, "rollout/truncation_rate"), config.get("truncation_rise")
    if start_truncated is not None and rise is not None:
        bounds.append(Bound(start_truncated + rise, f"truncation (start + {rise:g})", right=True))
    return bounds


# ---- panel-specific drawing ---------------------------------------------------------------------------------------
def step_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if "time/step_s" in r]


def moving_bound(
    records: list[dict[str, Any]],
    key: str,
    factor: float,
    window: int,
    keep: Callable[[dict], bool] = lambda r: True,
    minimum: int = MIN_NORMS,
) -> tuple[list[int], list[float]]:
    """`factor` x the guard's `recent_median` of `key` before each step: the guard's moving bounds, step by step."""
    history = step_records(records)
    steps, values = [], []
    for index, record in enumerate(history):
        median = recent_median(history[:index], key, window, keep, minimum)
        if median is not None:
            steps.append(record["step"])
            values.append(factor * median)
    return steps, values


def refusal_bound(
    records: list[dict[str, Any]], spike: float, window: int, minimum: int = MIN_NORMS
) -> tuple[list[int], list[float]]:
    """The gradient norm above which the guard refused each step's update: `spike` x the median of the applied norms
    among the `window` step records before it, once `minimum` of them exist (HealthGuard.skip_above)."""
    return moving_bound(records, "train/grad_norm", spike, window, was_applied, minimum)


def draw_length_bound(ax, records: list[dict[str, Any]], config: dict[str, Any] | None) -> None:
    """The guard's length blow-up bound: --health-length-blowup x the recent median p90."""
    if not config or config.get("length_blowup") is None or config.get("window") is None:
        return
    steps, values = moving_bound(records, "rollout/response_length_p90", config["length_blowup"], config["window"])
    if steps:
        shown = downsample(steps, values)
        label = f"blow-up ({config['length_blowup']:g} x recent median p90)"
        ax.plot(shown.steps, shown.means, color="tab:red", ls=":", lw=1, label=label)


def refused(record: dict[str, Any]) -> bool:
    """A step some of whose updates the optimizer did not apply."""
    steps, done = number(record, "train/steps"), number(record, "train/steps_applied")
    return (steps is not None and done is not None and done < steps) or (number(record, "health/refuses") or 0.0) > 0


def draw_refusals(ax, records: list[dict[str, Any]], config: dict[str, Any] | None) -> None:
    """Refused updates as red crosses at their gradient norm (a red dotted line when it was not finite), and the
    guard's refusal bound when its settings are known."""
    if config and config.get("grad_spike") is not None and config.get("window") is not None:
        minimum = spike_baseline_steps(config["window"], bool(config.get("adapters_from_zero")))
        steps, values = refusal_bound(records, config["grad_spike"], config["window"], minimum)
        if steps:
            shown = downsample(steps, values)
            ax.plot(
                shown.steps,
                shown.means,
                color="tab:red",
                ls=":",
                lw=1,
                label=f"refusal bound ({config['grad_spike']:g} x median)",
            )
    crosses = [
        (r["step"], number(r, "train/grad_norm_max") or number(r, "train/grad_norm")) for r in records if refused(r)
    ]
    drawn = [(step, norm) for step, norm in crosses if norm is not None and norm > 0]
    if drawn:
        ax.plot(
            [c[0] for c in drawn], [c[1] for c in drawn], "x", color="tab:red", markersize=6, label="refused update"
        )
    for step, norm in crosses:
        if norm is None or norm <= 0:
            ax.axvline(step, color="tab:red", ls=":", lw=0.8)


def draw_reward_spread(ax, records: list[dict[str, Any]], config: dict[str, Any] | None) -> None:
    """The band mean ± std of the rollout's rewards."""
    pairs = [(r["step"], number(r, "rollout/reward_mean"), number(r, "rollout/reward_std")) for r in records]
    pairs = [p for p in pairs if p[1] is not None and p[2] is not None]
    if not pairs:
        return
    steps = [p[0] for p in pairs]
    lower = downsample(steps, [p[1] - p[2] for p in pairs])
    upper = downsample(steps, [p[1] + p[2] for p in pairs])
    ax.fill_between(lower.steps, lower.means, upper.means, color=COLORS[0], alpha=0.15, linewidth=0, label="± std")


# ---- panels -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Panel:
    file: str
    title: str
    lines: tuple[tuple[str, str], ...]  # (metric, label) on the left axis
    right: tuple[tuple[str, str], ...] = ()  # metrics of another unit, on a second axis
    bounds: Bounds | None = None
    draw: Callable[[Any, list[dict[str, Any]], dict[str, Any] | None], None] | None = None  # what only it shows
    log: bool = False
    xlabel: str = "step"


HEALTH_PANELS = (
    Panel("health_entropy.png", "Policy entropy", (("train/entropy", "entropy"),), bounds=entropy_bounds),
    Panel(
        "health_logprob_gap.png",
        "Trainer - engine log-prob gap (mean |diff| per token)",
        (
            ("health/logprob_gap", "all tokens"),
            ("health/logprob_gap_lag0", "lag 0"),
            ("health/logprob_gap_lag1", "lag 1"),
            ("health/logprob_gap_lag2p", "lag 2+"),
            ("train/train_rollout_logprob_abs_diff", "in the loss"),
        ),
        bounds=fixed_bound("max_logprob_gap", "max gap"),
    ),
    Panel(
        "health_importance.png",
        "Importance weights",
        (
            ("health/is_capped_share", "share beyond the cap"),
            ("health/is_weight_mean", "mean weight"),
            ("train/tis_weight_mean", "mean TIS weight (capped)"),
            ("train/mis_masked_share", "share MIS took out of the loss"),
            ("train/mis_weight_mean", "mean MIS weight (applied)"),
            ("train/mis_weight_max", "largest MIS weight (applied)"),
        ),
        bounds=fixed_bound("max_is_capped_share", "max capped share"),
    ),
    Panel(
        "health_clipfrac.png",
        "Clip fractions",
        (
            ("train/pg_clipfrac", "PG clip (all)"),
            ("train/pg_clipfrac_high", "PG clip high"),
            ("train/pg_clipfrac_low", "PG clip low"),
            ("train/pg_clipfrac_dual", "PG dual clip"),
            ("train/tis_clipfrac", "TIS cap"),
        ),
    ),
    Panel(
        "health_kl.png",
        "KL",
        (("train/kl_old_new", "old -> new (the update)"), ("train/kl_loss", "to reference")),
        bounds=fixed_bound("max_update_kl", "max update KL"),
    ),
    Panel(
        "health_logp_shift.png",
        "The update's log-prob change per token",
        (("train/logp_shift_pos", "positive advantage"), ("train/logp_shift_neg", "negative advantage")),
        bounds=fixed_bound("min_positive_shift", "min shift of rewarded tokens"),
    ),
    Panel(
        "health_length.png",
        "Response length (tokens) and truncations",
        (
            ("rollout/response_length_p50", "p50"),
            ("rollout/response_length_p90", "p90"),
            ("rollout/response_length_max", "max"),
        ),
        right=(("rollout/truncation_rate", "truncation rate (right)"),),
        bounds=length_bounds,
        draw=draw_length_bound,
    ),
    Panel(
        "health_grad_norm.png",
        "Gradient norm",
        (("train/grad_norm", "grad norm"), ("train/grad_norm_max", "max over the step's updates")),
        draw=draw_refusals,
        log=True,
    ),
    Panel(
        "health_rates.png",
        "Rollout rates",
        (
            ("rollout/search_rate", "search rate"),
            ("rollout/reward_format_valid", "format valid"),
            ("rollout/invalid_action_rate", "invalid action"),
            ("rollout/zero_std_group_share", "zero-std groups"),
        ),
    ),
    Panel(
        "health_reward.png",
        "Training reward (mean ± std)",
        (("rollout/reward_mean", "mean"),),
        draw=draw_reward_spread,
    ),
)


def draw_line(ax, records: list[dict[str, Any]], key: str, label: str, color: str, log: bool) -> bool:
    """The metric's curve (bucket means with a min-max band when downsampled); returns whether it was downsampled."""
    steps, values = series(records, key)
    if log:
        kept = [(s, v) for s, v in zip(steps, values, strict=True) if v > 0]
        steps, values = [k[0] for k in kept], [k[1] for k in kept]
    shown = downsample(steps, values)
    marker = "o" if len(steps) <= MARKERS_UP_TO else None
    ax.plot(shown.steps, shown.means, marker=marker, markersize=3, color=color, label=label)
    if len(shown.steps) < len(steps):
        ax.fill_between(shown.steps, shown.lows, shown.highs, color=color, alpha=0.2, linewidth=0)
        return True
    return False


def draw_course(ax, events: list[dict[str, Any]]) -> None:
    """Vertical lines where the run rolled back and where it stopped."""
    rollbacks = sorted({e["step"] for e in events if e.get("action") == "rollback"})
    for index, step in enumerate(rollbacks):
        ax.axvline(step, color="tab:orange", ls="--", lw=1.2, label="rollback" if index == 0 else None)
    stops = [e["step"] for e in events if e.get("action") == "stop"]
    for index, step in enumerate(stops):
        ax.axvline(step, color="darkred", lw=1.8, label="stop" if index == 0 else None)


def draw_panel(plt, panel: Panel, records, events, config) -> Any | None:
    """The panel's figure, or None when the run recorded none of its metrics."""
    lines = [(key, label) for key, label in panel.lines if series(records, key)[0]]
    right = [(key, label) for key, label in panel.right if series(records, key)[0]]
    if not lines and not right:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 3.4), dpi=100)
    axes = [ax]
    if panel.log:
        ax.set_yscale("log")
    downsampled = [draw_line(ax, records, key, label, COLORS[i], panel.log) for i, (key, label) in enumerate(lines)]
    if right:
        twin = ax.twinx()
        axes.append(twin)
        downsampled += [
            draw_line(twin, records, key, label, COLORS[len(lines) + i], False) for i, (key, label) in enumerate(right)
        ]
    if panel.draw is not None:
        panel.draw(ax, records, config)
    for bound in panel.bounds(config, records) if panel.bounds and config else []:
        if bound.right and not right:
            continue  # its metric was not recorded: the bound has no axis of its unit
        # a bound of the second axis takes its curve's colour: a red one would read as a bound of the first axis
        target, color = (axes[-1], COLORS[len(lines)]) if bound.right else (ax, "tab:red")
        target.axhline(bound.value, color=color, ls=":", lw=1.2, label=bound.label)
    draw_course(ax, events)
    ax.set_title(panel.title, fontsize=10)
    note = " (bucket means; band: min-max)" if any(downsampled) else ""
    ax.set_xlabel(panel.xlabel + note)
    ax.grid(alpha=0.3)
    handles = [h for a in axes for h in a.get_legend_handles_labels()[0]]
    labels = [label for a in axes for label in a.get_legend_handles_labels()[1]]
    # beside the plot, not over it: a panel has up to eight entries
    ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.12 if right else 1.01, 1.0))
    fig.tight_layout()
    return fig


def plot_panels(
    panels: tuple[Panel, ...],
    records: list[dict[str, Any]],
    events: list[dict[str, Any]],
    config: dict[str, Any] | None,
    out_dir: Path,
) -> list[str]:
    """One PNG per panel that has data; returns the file names written. `config`: the guard's settings, None (no
    bounds drawn) when the run did not record them or ran without the guard."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if config is not None and config.get("enabled") is False:
        config = None
    written = []
    for panel in panels:
        fig = draw_panel(plt, panel, records, events, config)
        if fig is None:
            continue
        fig.savefig(out_dir / panel.file)
        plt.close(fig)
        written.append(panel.file)
    return written
