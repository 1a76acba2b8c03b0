"""The health guard: after every rollout, every batch and every step, the run's own numbers are checked, and what they
say is acted on, by severity.

    stop      the run cannot be trusted to go on: rewards that are not numbers above --max-reward-error-rate, an
              actor whose log-probs are not finite, too many skipped steps in a row, a rollback with no healthy
              checkpoint to go back to or none left (--max-rollbacks)
    skip      the step is not trained: more than --max-search-failure-rate of its searches failed (training on the
              trajectories that did not search teaches the policy not to search), or no sample is trainable
    refuse    the update is computed but not applied: its gradient norm is not finite, or spikes above
              --health-grad-spike x the median of the recent applied ones (decided inside the optimizer step)
    warn      a signal is beyond its bound: entropy collapse or explosion, the trainer-engine log-prob gap, the share
              of importance weights beyond the cap, response length blow-up, truncations
    rollback  a warning held --health-patience steps in a row, or the training reward (window mean) or a held-out
              metric fell from its best by more than its margin: the run goes back to the newest checkpoint that
              stayed clean for --health-confirm-steps steps and continues with a remedy
    end_on_best  at the end of the run, the final held-out evaluation is more than --health-end-drop below the best
              one of a kept checkpoint and that best lies above the final evaluation's interval: a late decline,
              too small or too late for a rollback; the run ends on that checkpoint's weights

The guard's state is a function of the run's records (metrics.jsonl) and its rollback count, so a resumed run
replays the records it kept and continues exactly where it was (`replay`). Without --health-guard only the stops
and skips of the first two kinds and non-finite updates remain.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slime_search.health.config import HealthConfig

ACTIONS = ("warn", "refuse", "skip", "rollback", "stop", "end_on_best")
MIN_NORMS = 3  # applied steps before a gradient-norm spike can be judged
LENGTH_RULES = ("length_blowup", "truncation")  # escalate only with the reward down too


@dataclass(frozen=True)
class Event:
    """One decision of the guard: a line of RUN/health.jsonl and of the report."""

    step: int
    action: str  # one of ACTIONS
    rule: str
    message: str
    values: dict[str, float] = field(default_factory=dict)

    def record(self, attempt: int) -> dict[str, Any]:
        return {
            "step": self.step,
            "action": self.action,
            "rule": self.rule,
            "message": self.message,
            "values": self.values,
            "attempt": attempt,
        }


class RunStopped(RuntimeError):
    """The guard stopped the run; the message names the rule, the step and the values."""


def _num(metrics: dict[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class HealthGuard:
    def __init__(self, config: HealthConfig, reward_key: str = "score"):
        self.config = config
        self.eval_key = f"eval/{reward_key}"
        self.rollbacks = 0
        self._history: list[dict[str, Any]] = []  # step records of the current timeline, in order
        self._streaks: dict[str, int] = {}  # warning rule -> consecutive steps it held
        self._skipped_in_a_row = 0
        self._troubled: set[int] = set()  # steps with a warning, a refused update or a skip
        self._evals: list[tuple[int, float]] = []  # (version, held-out metric) of the current timeline
        self._eval_highs: dict[int, float] = {}  # version -> the upper bound of its held-out metric's interval

    # ---- before training: what the rollout returned ---------------------------------------------------------------
    def check_rollout(self, step: int, metrics: dict[str, Any], errors: dict[str, str]) -> list[Event]:
        """Stop on unusable rewards above their rate; skip a step whose searches failed or that has no trainable
        sample; warn on the samples lost below those bounds."""
        samples = _num(metrics, "rollout/samples") or 0.0
        if errors.get("stop_run"):  # a plugin asked the run to stop (e.g. its web-search budget is spent)
            return [Event(step, "stop", "stop_run", f"step {step}: {errors['stop_run']}", {"samples": samples})]
        events: list[Event] = []
        bad_rewards = _num(metrics, "rollout/reward_errors") or 0.0
        if bad_rewards:
            rate = bad_rewards / max(samples, 1.0)
            values = {"reward_errors": bad_rewards, "samples": samples, "rate": rate}
            first = errors.get("reward_error", "")
            if rate > self.config.max_reward_error_rate:
                message = (
                    f"step {step}: {bad_rewards:.0f} of {samples:.0f} rewards were not usable (rate {rate:.3f} > "
                    f"--max-reward-error-rate {self.config.max_reward_error_rate}); first: {first}"
                )
                return [Event(step, "stop", "reward_errors", message, values)]
            events.append(Event(step, "warn", "reward_errors", f"{bad_rewards:.0f} rewards left out: {first}", values))
        bad_log_probs = _num(metrics, "rollout/nonfinite_log_probs") or 0.0
        if bad_log_probs:
            message = f"{bad_log_probs:.0f} samples left out: {errors.get('nonfinite_logprob', '')}"
            events.append(Event(step, "warn", "engine_log_probs", message, {"samples": bad_log_probs}))
        calls = _num(metrics, "rollout/search_calls") or 0.0
        failures = _num(metrics, "rollout/search_failures") or 0.0
        if calls and failures / calls > self.config.max_search_failure_rate:
            rate = failures / calls
            message = (
                f"step {step}: {failures:.0f} of {calls:.0f} search calls failed (rate {rate:.3f} > "
                f"--max-search-failure-rate {self.config.max_search_failure_rate}); first: "
                f"{errors.get('search_error', '')}"
            )
            return [*events, self._skip(step, "search_failures", message, {"failures": failures, "calls": calls})]
        if not _num(metrics, "rollout/trainable"):
            message = f"step {step}: no trainable sample ({no_sample_cause(metrics, errors)})"
            return [*events, self._skip(step, "no_trainable_sample", message, {"samples": samples})]
        return events

    def _skip(self, step: int, rule: str, message: str, values: dict[str, float]) -> Event:
        """A skipped step; the last one allowed in a row becomes a stop."""
        if self._skipped_in_a_row + 1 >= self.config.max_skipped_steps:
            message = f"{self._skipped_in_a_row + 1} steps in a row skipped; the last: {message}"
            return Event(step, "stop", rule, message, values)
        return Event(step, "skip", rule, message, values)

    def check_batch(self, step: int, metrics: dict[str, Any]) -> list[Event]:
        """After the trainer's log-probs: an actor whose log-probs are not finite has non-finite weights; nothing it
        would train or save can be trusted."""
        bad = _num(metrics, "health/nonfinite_old_log_probs") or 0.0
        if bad:
            message = f"step {step}: the actor's log-probs of {bad:.0f} tokens are not finite: its weights are damaged"
            return [Event(step, "stop", "nonfinite_weights", message, {"tokens": bad})]
        return []

    # ---- the update ---------------------------------------------------------------------------------------------
    def skip_above(self) -> float | None:
        """The gradient norm above which an update is refused: --health-grad-spike x the median of the recent applied
        steps' (None until there are MIN_NORMS of them, or with the guard off)."""
        if not self.config.enabled:
            return None
        median = recent_median(self._history, "train/grad_norm", self.config.window, was_applied)
        return None if median is None else self.config.grad_spike * median

    # ---- after the step --------------------------------------------------------------------------------------------
    def review(self, step: int, metrics: dict[str, Any]) -> list[Event]:
        """The step's events (refused updates, warnings, a rollback when one is due), then the step joins the
        history. `metrics` is the step's whole record, health/step_skipped included."""
        events = self._refusals(step, metrics)
        if self.config.enabled and not metrics.get("health/step_skipped"):
            warnings = self._warnings(step, metrics)
            events += warnings
            events += self._escalations(step, {event.rule for event in warnings}, metrics)
            events += self._policy_jump(step, metrics)
            events += self._reward_drop(step, metrics)
        self._observe(step, metrics, events)
        return events

    def review_eval(self, version: int, metrics: dict[str, Any]) -> list[Event]:
        """A held-out evaluation of `version`: a rollback when the reward key's metric fell from its best by more than
        the margin; the trouble began after the last version still within it."""
        value = _num(metrics, self.eval_key)
        if value is None:
            return []
        events = []
        best = max((v for _, v in self._evals), default=None)
        if self.config.enabled and best is not None and best - value > self.config.eval_drop:
            last_good = max(ver for ver, v in self._evals if best - v <= self.config.eval_drop)
            message = (
                f"{self.eval_key} {value:.3f} at version {version}, {best - value:.3f} below its best {best:.3f} "
                f"(--health-eval-drop {self.config.eval_drop}); version {last_good} was the last within it"
            )
            events.append(
                Event(
                    version, "rollback", "eval_drop", message, {"value": value, "best": best, "since": float(last_good)}
                )
            )
        self._evals.append((version, value))
        high = _num(metrics, f"{self.eval_key}_high")
        if high is not None:
            self._eval_highs[version] = high
        return events

    def best_kept_eval(self, checkpoints: list[int]) -> tuple[int, float] | None:
        """(version, metric) of the best held-out evaluation of a version that has a checkpoint (the newest of
        equals); None without one. --keep-checkpoints must not remove it while --health-end-drop may end on it."""
        kept = set(checkpoints)
        scored = [(value, version) for version, value in self._evals if version in kept]
        if not scored:
            return None
        value, version = max(scored)
        return version, value

    def protected_best(self, checkpoints: list[int]) -> int | None:
        """The best evaluated checkpoint, which --keep-checkpoints must not remove while the run may end on it."""
        if not self.config.enabled or not self.config.end_drop:
            return None
        best = self.best_kept_eval(checkpoints)
        return None if best is None else best[0]

    def end_on_best(self, checkpoints: list[int]) -> Event | None:
        """At the end of the run: whether to end on the best evaluated checkpoint instead of the last weights. Only
        a decline that is both larger than --health-end-drop and beyond the final evaluation's own interval (its
        upper bound below the best) counts: the best of many noisy evaluations is high by chance, and a plateau
        run must end on its last weights."""
        if not self.config.enabled or not self.config.end_drop or not self._evals:
            return None
        final_version, final = self._evals[-1]
        best = self.best_kept_eval(checkpoints)
        high = self._eval_highs.get(final_version)
        if best is None or best[0] == final_version or high is None:
            return None
        version, value = best
        if value - final <= self.config.end_drop or high >= value:
            return None
        message = (
            f"{self.eval_key} {final:.3f} at the final version {final_version} (interval up to {high:.3f}) is "
            f"{value - final:.3f} below {value:.3f} at version {version} (--health-end-drop {self.config.end_drop}): "
            f"the run ends on the checkpoint of step {version}"
        )
        values = {"value": final, "high": high, "best": value, "ended_on": float(version)}
        return Event(final_version, "end_on_best", "late_decline", message, values)

    def _refusals(self, step: int, metrics: dict[str, Any]) -> list[Event]:
        """Updates the optimizer refused. A step none of whose updates was applied learned nothing: it counts as a
        skipped step (and the last one allowed in a row stops the run)."""
        steps, applied = _num(metrics, "train/steps"), _num(metrics, "train/steps_applied")
        if steps is None or applied is None or applied >= steps:
            return []
        norm = _num(metrics, "train/grad_norm_max")
        finite = norm is not None and abs(norm) < float("inf")
        rule = "grad_spike" if finite else "nonfinite_gradient"
        message = f"step {step}: {steps - applied:.0f} of {steps:.0f} updates not applied (gradient norm {norm})"
        values = {"grad_norm": norm if finite else -1.0, "refused": steps - applied}
        if applied == 0:
            skip = self._skip(step, rule, message, values)
            return [skip if skip.action == "stop" else Event(step, "refuse", rule, message, values)]
        return [Event(step, "refuse", rule, message, values)]

    def _warnings(self, step: int, metrics: dict[str, Any]) -> list[Event]:
        c = self.config
        events = []

        def warn(rule: str, message: str, **values: float) -> None:
            events.append(Event(step, "warn", rule, f"step {step}: {message}", values))

        entropy, start = _num(metrics, "train/entropy"), self._baseline("train/entropy")
        if entropy is not None and start:
            if entropy < c.entropy_low * start:
                warn(
                    "entropy_collapse",
                    f"entropy {entropy:.4g} < {c.entropy_low} x its start {start:.4g}",
                    value=entropy,
                    start=start,
                )
            elif entropy > c.entropy_high * start:
                warn(
                    "entropy_explosion",
                    f"entropy {entropy:.4g} > {c.entropy_high} x its start {start:.4g}",
                    value=entropy,
                    start=start,
                )
        gaps = {k: v for k, v in metrics.items() if k.startswith("health/logprob_gap") and _num(metrics, k) is not None}
        worst = max(gaps.items(), key=lambda kv: kv[1], default=None)
        if worst is not None and worst[1] > c.max_logprob_gap:
            warn(
                "logprob_gap",
                f"{worst[0]} {worst[1]:.4g} > --health-max-logprob-gap {c.max_logprob_gap}",
                value=float(worst[1]),
            )
        capped = _num(metrics, "health/is_capped_share")
        if capped is not None and capped > c.max_is_capped_share:
            warn(
                "is_weight_tail",
                f"{capped:.3f} of tokens beyond the importance-weight cap (> {c.max_is_capped_share})",
                value=capped,
            )
        length, usual = _num(metrics, "rollout/response_length_p90"), self._recent_median("rollout/response_length_p90")
        if length is not None and usual and length > c.length_blowup * usual:
            warn(
                "length_blowup",
                f"p90 response length {length:.0f} > {c.length_blowup} x its recent median {usual:.0f}",
                value=length,
                usual=usual,
            )
        shift = _num(metrics, "train/logp_shift_pos")
        if shift is not None and shift < c.min_positive_shift:
            warn(
                "likelihood_displacement",
                f"rewarded tokens lost {-shift:.3g} nats each in the update "
                f"(--health-min-positive-shift {c.min_positive_shift})",
                value=shift,
            )
        if _num(metrics, "rollout/zero_std_group_share") == 1.0:
            warn(
                "no_reward_signal", "no group's rewards differ (a constant reward?): the step learns nothing", value=1.0
            )
        truncated, start = _num(metrics, "rollout/truncation_rate"), self._baseline("rollout/truncation_rate")
        if truncated is not None and start is not None and truncated - start > c.truncation_rise:
            warn(
                "truncation",
                f"{truncated:.3f} of samples truncated, {c.truncation_rise} or more above its start {start:.3f}",
                value=truncated,
                start=start,
            )
        return events

    def _escalations(self, step: int, warned: set[str], metrics: dict[str, Any]) -> list[Event]:
        """A rollback when a warning has held --health-patience steps in a row; `since`: the streak's first step. A
        warning that has held since the run's first step is a standing condition, not a change: there is no healthier
        state to go back to, so it stays a warning. Longer responses alone are no sign of trouble (a policy that
        learns to search more writes more): a length warning escalates only while the training reward is down too."""
        first = self._history[0]["step"] if self._history else step
        streaks = {rule: self._streaks.get(rule, 0) + 1 for rule in warned}
        shortfall = self._reward_shortfall(metrics)
        reward_down = shortfall is not None and shortfall[1] - shortfall[0] > self.config.length_reward_dip
        lasting = sorted(
            (
                rule
                for rule, n in streaks.items()
                if n >= self.config.patience and step - n + 1 > first and (rule not in LENGTH_RULES or reward_down)
            ),
            key=lambda r: -streaks[r],
        )
        if not lasting:
            return []
        message = f"step {step}: {', '.join(lasting)} held {streaks[lasting[0]]} steps in a row"
        since = step - streaks[lasting[0]] + 1
        return [Event(step, "rollback", lasting[0], message, {"since": float(since)})]

    def _policy_jump(self, step: int, metrics: dict[str, Any]) -> list[Event]:
        """One update that moved the policy this far on what it trained on broke it (at lr 1e-2 the miniature's first
        step moved it 4.6 nats a token and it never answered again): no need to wait for the reward to show it."""
        kl = _num(metrics, "train/kl_old_new")
        if kl is None or kl <= self.config.max_update_kl:
            return []
        message = (
            f"step {step}: the update moved the policy KL {kl:.3g} per token (> --health-max-update-kl "
            f"{self.config.max_update_kl})"
        )
        return [Event(step, "rollback", "policy_jump", message, {"value": kl, "since": float(step)})]

    @property
    def reward_window(self) -> int:
        return max(1, self.config.window // 2)

    def _reward_shortfall(self, metrics: dict[str, Any]) -> tuple[float, float, int] | None:
        """The training reward's mean over the last `reward_window` steps (this one included), the best such mean so
        far and the step its window began; None before there are two windows."""
        records = [r for r in [*self._history, metrics] if _num(r, "rollout/reward_mean") is not None]
        width = self.reward_window
        means = [
            (records[i - width]["step"], sum(r["rollout/reward_mean"] for r in records[i - width : i]) / width)
            for i in range(width, len(records) + 1)
        ]
        if len(means) < 2:
            return None
        best_since, best = max(means, key=lambda m: m[1])
        return means[-1][1], best, best_since

    def _reward_drop(self, step: int, metrics: dict[str, Any]) -> list[Event]:
        """The training reward's mean over the last `reward_window` steps against the best such mean so far."""
        shortfall = self._reward_shortfall(metrics)
        if shortfall is None:
            return []
        now, best, best_since = shortfall
        width = self.reward_window
        if best - now <= self.config.reward_drop:
            return []
        message = (
            f"step {step}: training reward {now:.3f} (mean of {width} steps), {best - now:.3f} below its best "
            f"{best:.3f} (--health-reward-drop {self.config.reward_drop})"
        )
        return [Event(step, "rollback", "reward_drop", message, {"value": now, "best": best, "since": best_since})]

    def _recent_median(self, key: str) -> float | None:
        """The median of `key` over the last --health-window steps (a batch's length depends on what finished first in
        asynchronous modes, so a run's first batch is no yardstick for length)."""
        return recent_median(self._history, key, self.config.window)

    def _baseline(self, key: str) -> float | None:
        return starting_value(self._history, key)

    def _observe(self, step: int, metrics: dict[str, Any], events: list[Event]) -> None:
        warned = {e.rule for e in events if e.action == "warn"}
        self._streaks = {rule: self._streaks.get(rule, 0) + 1 for rule in warned}
        skipped = bool(metrics.get("health/step_skipped")) or (
            _num(metrics, "train/steps_applied") == 0.0 and bool(_num(metrics, "train/steps"))
        )
        self._skipped_in_a_row = self._skipped_in_a_row + 1 if skipped else 0
        # a warning that has held since the run's first step is how this run is, not a change: it does not keep a
        # checkpoint from being confirmed (else a run that truncates from the start could never roll back)
        first = self._history[0]["step"] if self._history else step
        changed = [rule for rule in warned if step - self._streaks[rule] + 1 > first]
        if skipped or changed or any(e.action in ("refuse", "skip") for e in events):
            self._troubled.add(step)
        self._history.append({**metrics, "step": step})

    # ---- checkpoints and rollbacks ---------------------------------------------------------------------------
    def healthy_checkpoint(self, checkpoints: list[int], before: int) -> int | None:
        """The newest of `checkpoints` (steps done) at or before `before` whose neighbourhood stayed clean: the step
        that produced it and the --health-confirm-steps steps after it raised nothing."""
        last = self._history[-1]["step"] if self._history else -1
        for k in sorted(checkpoints, reverse=True):
            if k == 0 and before >= 0:
                return 0  # the weights the run started from: the user's choice, trusted without confirmation
            if k > before or k + self.config.confirm_steps - 1 > last:
                continue
            if not any(s in self._troubled for s in range(max(0, k - 1), k + self.config.confirm_steps)):
                return k
        return None

    def stop_checkpoint(self, checkpoints: list[int], before: int) -> int | None:
        """The checkpoint a run the guard stops ends on: of the checkpoints at or before `before` (where the trouble
        began), the best evaluated one when its held-out metric beats that of the last healthy one
        (`healthy_checkpoint`), else that one. Nothing trains on from a stopped run, so what counts is what its
        weights score, not whether the steps after them were clean; a tie goes to the healthy one."""
        healthy = self.healthy_checkpoint(checkpoints, before)
        scores = dict(self._evals)
        candidates = [k for k in checkpoints if k <= before and k in scores]
        if not candidates:
            return healthy
        best = max(candidates, key=lambda k: (scores[k], k))
        if healthy is None or scores[best] > scores.get(healthy, float("-inf")):
            return best
        return healthy

    def protected_checkpoint(self, checkpoints: list[int]) -> int | None:
        """The checkpoint a rollback would go back to now, which --keep-checkpoints must not remove."""
        return self.healthy_checkpoint(checkpoints, before=self._history[-1]["step"] + 1 if self._history else 0)

    def rolled_back(self, to_step: int) -> None:
        """The run continues from `to_step` (steps done at the checkpoint): later history is forgotten."""
        self.rollbacks += 1
        self._history = [r for r in self._history if r["step"] < to_step]
        self._troubled = {s for s in self._troubled if s < to_step}
        self._streaks, self._skipped_in_a_row = {}, 0
        self._evals = [(version, value) for version, value in self._evals if version < to_step]
        self._eval_highs = {version: high for version, high in self._eval_highs.items() if version < to_step}

    def replay(self, records: list[dict[str, Any]], rollbacks: int) -> None:
        """Rebuild the state of a resumed run from the records it kept (in file order) and its rollback count."""
        self.rollbacks = rollbacks
        for record in records:
            if "time/step_s" in record:
                self.review(record["step"], record)
            elif self.eval_key in record:
                self.review_eval(record["step"], record)


def was_applied(record: dict[str, Any]) -> bool:
    """A step whose update (one at least) was applied."""
    return (_num(record, "train/steps_applied") or 0.0) > 0


def recent_median(
    records: list[dict[str, Any]], key: str, window: int, keep: Callable[[dict[str, Any]], bool] = lambda r: True
) -> float | None:
    """The median of `key`'s finite values in the last `window` of `records` (step records) that `keep` accepts; None
    before MIN_NORMS of them. The guard's moving yardstick (spike and length bounds), and the report's drawing of it."""
    values = [v for r in records[-window:] if keep(r) and (v := _num(r, key)) is not None and math.isfinite(v)]
    return statistics.median(values) if len(values) >= MIN_NORMS else None


def starting_value(records: list[dict[str, Any]], key: str) -> float | None:
    """A signal's value at the run's first step: measured on the rollouts of the policy the run started from, before
    any update. (A median over the first steps would take in a collapse that begins at the first update.)"""
    return next((float(r[key]) for r in records if "time/step_s" in r and _num(r, key) is not None), None)


def no_sample_cause(metrics: dict[str, Any], errors: dict[str, str]) -> str:
    """Why a rollout left nothing to train on, in words."""
    if errors:
        return "; ".join(f"{cause}: {message}" for cause, message in errors.items())
    if metrics.get("rollout/groups_dropped_zero_std"):
        return f"all {metrics['rollout/groups_dropped_zero_std']:.0f} groups were filtered for zero reward std"
    return "the rollout returned no sample"
