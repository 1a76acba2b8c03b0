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
    repush    a trainer-engine mismatch (the log-prob gap, or importance weights beyond the cap) held --health-patience
              steps: the engines may serve other weights than the trainer's, so the weights are pushed again before
              the policy is blamed; a mismatch that holds half as long again after that rolls back
    rollback  a warning held --health-patience steps in a row, or the training reward (window mean) or a held-out
              metric fell from its best by more than its margin: the run goes back to the newest checkpoint that
              stayed clean for --health-confirm-steps steps (health.policy) and continues with a remedy
    end_on_best  at the end of the run, the final held-out evaluation is more than --health-end-drop below the best
              one of a kept checkpoint, beyond chance (or confirmed on questions the evaluations left out): a late
              decline, too small or too late for a rollback; the run ends on that checkpoint's weights

Each rule applies where its signal means something: with a demonstrator engine (SFT) the trainer-engine gap and the
importance weights compare two different models, and without reward groups there is no reward signal to miss.

The guard's state is a function of the run's records (metrics.jsonl) and its rollbacks, so a resumed run replays the
records it kept and continues exactly where it was (`replay`). Without --health-guard only the stops and skips of the
first two kinds and non-finite updates remain.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from slime_search.health.config import HealthConfig
from slime_search.health.heldout import paired_drop_is_real
from slime_search.health.policy import RollbackPolicy, Timeline
from slime_search.health.records import num as _num
from slime_search.health.records import recent_median, starting_value, was_applied

# "watch" is the guard's notice, not a warning: a first held-out fall, whose checkpoint it keeps while it waits for the
# next evaluations (most falls recover by themselves); the user has nothing to do unless it acts
ACTIONS = ("watch", "warn", "refuse", "skip", "repush", "rollback", "stop", "end_on_best")
LENGTH_RULES = ("length_blowup", "truncation")  # a sign of trouble only with the reward down too
ENGINE_RULES = ("logprob_gap", "is_weight_tail")  # compare the trainer with the engine that sampled
BEFORE = (
    "roll_back_before"  # a rollback event's value: the trouble began after this step; the target is at or before it
)
LEVEL_SHIFT_REFUSALS = 2  # refused updates in a row at one gradient-norm level: a new level, not a spike


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


class HealthGuard:
    def __init__(self, config: HealthConfig, reward_key: str = "score"):
        self.config = config
        self.eval_key = f"eval/{reward_key}"
        self.rollback_steps: list[int] = []  # the step of every rollback done, over the run's life
        self.rollback_targets: list[int] = []  # the checkpoint each of them went back to, in the same order
        self.timeline = Timeline()
        self.policy = RollbackPolicy(config.confirm_steps, self.timeline)
        self._streaks: dict[str, int] = {}  # warning rule -> consecutive steps it held
        self._skipped_in_a_row = 0
        self._refused: list[tuple[int, float]] = []  # (step, gradient norm) of the current run of refused updates
        self._level: tuple[int, set[int]] | None = None  # a gradient-norm level the baseline follows: (from, refused)
        self._repushed_at: int | None = None  # the engine-mismatch streak's length when the weights were pushed again
        self._drops_in_a_row = 0  # held-out evaluations in a row below the best by more than the margin

    @property
    def rollbacks(self) -> int:
        return len(self.rollback_steps)

    def recent_rollbacks(self, step: int) -> int:
        """Rollbacks within --health-rollback-window steps before `step` (all of them with a window of 0). The budget
        of --max-rollbacks and the learning-rate remedy count these: a false alarm early in a week-long run does not
        use the run's budget up or halve its learning rate for good."""
        window = self.config.rollback_window
        return sum(1 for at in self.rollback_steps if not window or at > step - window)

    def rollback_left(self, step: int) -> bool:
        return self.recent_rollbacks(step) < self.config.max_rollbacks

    def rollback_target(self, checkpoints: list[int], before: int) -> int | None:
        """Where a rollback for trouble that began after `before` goes (RollbackPolicy.target), passing over the
        targets of recent rollbacks: the trouble came back from there with the remedy applied."""
        return self.policy.target(checkpoints, before, passed_over=self._recent_targets())

    def _recent_targets(self) -> set[int]:
        """The targets of the rollbacks that still count against the budget (--health-rollback-window)."""
        window, last = self.config.rollback_window, self.timeline.last_step()
        return {
            to
            for at, to in zip(self.rollback_steps, self.rollback_targets, strict=False)
            if not window or at > last - window
        }

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
        steps' (None until there are MIN_NORMS of them, or with the guard off). Refused updates in a row at one level
        (within the spike factor of each other) are a lasting change of level, not a spike: GRPO's gradient grows
        with the share of groups whose rewards differ, which can rise tenfold early in a run. The bound then follows
        that level instead of refusing every step until the run stops."""
        if not self.config.enabled:
            return None
        spike = self.config.grad_spike
        norms = [norm for _, norm in self._refused]
        if len(norms) >= LEVEL_SHIFT_REFUSALS and max(norms) <= spike * min(norms):
            return spike * statistics.median(norms)
        median = recent_median(self._baseline_records(), "train/grad_norm", self.config.window, self._counts_for_norm)
        return None if median is None else spike * median

    def _baseline_records(self) -> list[dict[str, Any]]:
        history = self.timeline.history
        return history if self._level is None else [r for r in history if r["step"] >= self._level[0]]

    def _counts_for_norm(self, record: dict[str, Any]) -> bool:
        return was_applied(record) or (self._level is not None and record["step"] in self._level[1])

    # ---- after the step --------------------------------------------------------------------------------------------
    def review(self, step: int, metrics: dict[str, Any]) -> list[Event]:
        """The step's events (refused updates, warnings, a re-push or a rollback when one is due), then the step
        joins the history. `metrics` is the step's whole record, health/step_skipped included."""
        events = self._refusals(step, metrics)
        if self.config.enabled and not metrics.get("health/step_skipped"):
            warnings = self._warnings(step, metrics)
            events += warnings
            events += self._escalations(step, {event.rule for event in warnings}, metrics)
            events += self._policy_jump(step, metrics)
            events += self._reward_drop(step, metrics)
        self._observe(step, metrics, events)
        return events

    def review_eval(self, version: int, metrics: dict[str, Any], grades: list[float] | None = None) -> list[Event]:
        """A held-out evaluation of `version` (`grades`: its per-question grades of the reward key, in the eval set's
        order). A fall from the best by more than --health-eval-drop, beyond chance where both versions' grades pair up
        (health.heldout), is first watched: the checkpoint of the last version within the margin is kept; when
        --health-eval-patience evaluations in a row fall so, the run rolls back to before them. Held-out falls
        often recover by the next evaluation; a collapse does not: so a fall the guard waits on is a "watch" (logged
        as information, listed in the report), and only the rollback is a decision the user hears of as a warning."""
        value = _num(metrics, self.eval_key)
        if value is None:
            return []
        events = []
        if self.config.enabled and self._held_out_fell(value, grades):
            self._drops_in_a_row += 1
            best = max(v for _, v in self.timeline.evals)
            last_good = self._last_good_eval()
            message = (
                f"{self.eval_key} {value:.3f} at version {version}, {best - value:.3f} below its best {best:.3f} "
                f"(--health-eval-drop {self.config.eval_drop}); version {last_good} was the last within it"
            )
            values = {"value": value, "best": best, BEFORE: float(last_good)}
            if self._drops_in_a_row >= self.config.eval_patience:
                events.append(Event(version, "rollback", "eval_drop", message, values))
            else:
                left = self.config.eval_patience - self._drops_in_a_row
                message += (
                    "; watching: the checkpoints a rollback would use are kept, and the run rolls back if the next "
                    f"{left} evaluation{'s' if left > 1 else ''} stay{'' if left > 1 else 's'} down"
                )
                events.append(Event(version, "watch", "eval_drop", message, values))
        else:
            self._drops_in_a_row = 0
        self.timeline.evals.append((version, value))
        if grades is not None:
            self.timeline.grades[version] = list(grades)
        high = _num(metrics, f"{self.eval_key}_high")
        if high is not None:
            self.timeline.eval_highs[version] = high
        return events

    def _held_out_fell(self, value: float, grades: list[float] | None) -> bool:
        """Below the best evaluation by more than the margin, and beyond chance when the two pair up."""
        evals = self.timeline.evals
        if not evals:
            return False
        best_value, best_version = max((v, version) for version, v in evals)
        if best_value - value <= self.config.eval_drop:
            return False
        real = paired_drop_is_real(self.timeline.grades.get(best_version), grades, len(evals) + 1)
        return real is not False

    def _last_good_eval(self) -> int:
        best = max(v for _, v in self.timeline.evals)
        return max(version for version, v in self.timeline.evals if best - v <= self.config.eval_drop)

    def end_candidate(self, checkpoints: list[int]) -> tuple[int, float] | None:
        """(version, value) of the best evaluated kept checkpoint, when the final held-out evaluation is more than
        --health-end-drop below it."""
        if not self.config.enabled or not self.config.end_drop or not self.timeline.evals:
            return None
        final_version, final = self.timeline.evals[-1]
        best = self.policy.best_evaluated(checkpoints)
        if best is None or best[0] == final_version or best[1] - final <= self.config.end_drop:
            return None
        return best

    def end_on_best(self, checkpoints: list[int]) -> Event | None:
        """At the end of the run: whether to end on the best evaluated checkpoint instead of the last weights. Only
        a decline larger than --health-end-drop and beyond chance counts: paired per question with the best chosen
        among all the evaluations (health.heldout) where both have grades, else the final evaluation's interval's
        upper bound below the best."""
        best = self.end_candidate(checkpoints)
        if best is None:
            return None
        (version, value), (final_version, final), grades = best, self.timeline.evals[-1], self.timeline.grades
        paired = paired_drop_is_real(grades.get(version), grades.get(final_version), len(self.timeline.evals))
        high = self.timeline.eval_highs.get(final_version)
        if paired is False or (paired is None and (high is None or high >= value)):
            return None
        beyond = "beyond chance, paired per question" if paired else f"interval up to {high:.3f}"
        message = (
            f"{self.eval_key} {final:.3f} at the final version {final_version} ({beyond}) is "
            f"{value - final:.3f} below {value:.3f} at version {version} (--health-end-drop {self.config.end_drop}): "
            f"the run ends on the checkpoint of step {version}"
        )
        values = {"value": final, "best": value, "ended_on": float(version)}
        if high is not None:
            values["high"] = high
        return Event(final_version, "end_on_best", "late_decline", message, values)

    def end_on_confirmed(self, version: int, best: list[float], final: list[float]) -> Event | None:
        """The end_candidate the evaluations could not settle, checked on questions they did not grade: the run ends
        on checkpoint `version` only if its grades (`best`) beat the final weights' beyond chance, one paired test."""
        if paired_drop_is_real(best, final, 1) is not True:
            return None
        (final_version, final_value), value = self.timeline.evals[-1], dict(self.timeline.evals)[version]
        on_best, on_final = sum(best) / len(best), sum(final) / len(final)
        message = (f"{self.eval_key} {final_value:.3f} at the final version {final_version} is {value - final_value:.3f} "
                   f"below {value:.3f} at version {version} (--health-end-drop {self.config.end_drop}), and on "
                   f"{len(best)} questions the evaluations did not grade {on_final:.3f} against {on_best:.3f} (beyond "
                   f"chance, paired per question): the run ends on the checkpoint of step {version}")  # fmt: skip
        values = {"value": final_value, "best": value, "ended_on": float(version), "fresh_final": on_final}
        return Event(final_version, "end_on_best", "late_decline", message, {**values, "fresh_best": on_best})

    def _refusals(self, step: int, metrics: dict[str, Any]) -> list[Event]:
        """Updates the optimizer refused. A step none of whose updates was applied learned nothing: it counts as a
        skipped step (and the last one allowed in a row stops the run)."""
        steps, applied = _num(metrics, "train/steps"), _num(metrics, "train/steps_applied")
        if steps is None or applied is None or applied >= steps:
            return []
        norm = _num(metrics, "train/grad_norm_max")
        rule = "grad_spike" if norm is not None else "nonfinite_gradient"
        shown = norm if norm is not None else metrics.get("train/grad_norm_max")
        message = f"step {step}: {steps - applied:.0f} of {steps:.0f} updates not applied (gradient norm {shown})"
        values = {"grad_norm": norm if norm is not None else -1.0, "refused": steps - applied}
        if applied == 0:
            skip = self._skip(step, rule, message, values)
            return [skip if skip.action == "stop" else Event(step, "refuse", rule, message, values)]
        return [Event(step, "refuse", rule, message, values)]

    def _warnings(self, step: int, metrics: dict[str, Any]) -> list[Event]:
        c = self.config
        events = []

        reward_down = self._reward_down(metrics)

        def warn(rule: str, message: str, **values: float) -> None:
            if rule in ENGINE_RULES and not c.engine_serves_policy:
                return  # a demonstrator engine is another model: the gap and the weights measure that, not a fault
            if rule in LENGTH_RULES and not reward_down:
                return  # longer answers with the reward up are a policy that learns to search more: nothing to act on
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
        gaps = {k: v for k in metrics if k.startswith("health/logprob_gap") and (v := _num(metrics, k)) is not None}
        worst = max(gaps.items(), key=lambda kv: kv[1], default=None)
        if worst is not None and worst[1] > c.max_logprob_gap:
            warn(
                "logprob_gap",
                f"{worst[0]} {worst[1]:.4g} > --health-max-logprob-gap {c.max_logprob_gap}",
                value=worst[1],
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
        if c.rewards_grouped and _num(metrics, "rollout/zero_std_group_share") == 1.0:
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

    def _lasting(self, step: int, streaks: dict[str, int], metrics: dict[str, Any]) -> list[str]:
        """The warned rules that changed the run: not standing conditions (held since the run's first step: there is
        no healthier state to go back to), and length rules only while the training reward is down too (longer
        responses alone are no sign of trouble: a policy that learns to search more writes more). Only these may
        escalate, and only these keep a checkpoint from being confirmed."""
        first = self.timeline.first_step(step)
        reward_down = self._reward_down(metrics)
        return [
            rule for rule, n in streaks.items() if step - n + 1 > first and (rule not in LENGTH_RULES or reward_down)
        ]

    def _escalations(self, step: int, warned: set[str], metrics: dict[str, Any]) -> list[Event]:
        """A warning that has held --health-patience steps in a row: a re-push of the weights for a log-prob gap the
        first time (the engines may serve other weights than the trainer's), else a rollback to before the streak's
        first step."""
        streaks = {rule: self._streaks.get(rule, 0) + 1 for rule in warned}
        lasting = sorted(
            (rule for rule in self._lasting(step, streaks, metrics) if self._due(rule, streaks[rule])),
            key=lambda r: -streaks[r],
        )
        if not lasting:
            return []
        rule = lasting[0]
        message = f"step {step}: {', '.join(lasting)} held {streaks[rule]} steps in a row"
        if rule in ENGINE_RULES and self._repushed_at is None:
            message += "; the weights are pushed to the engines again before the policy is blamed"
            return [Event(step, "repush", rule, message, {"held": float(streaks[rule])})]
        return [Event(step, "rollback", rule, message, {BEFORE: float(step - streaks[rule] + 1)})]

    def _due(self, rule: str, held: int) -> bool:
        """Whether a warning that held `held` steps escalates now: after --health-patience steps, and a trainer-engine
        mismatch that held on after its re-push after half as many more (the engines then hold the trainer's weights:
        what is left is the policy's)."""
        if rule not in ENGINE_RULES or self._repushed_at is None:
            return held >= self.config.patience
        return held - self._repushed_at >= max(1, self.config.patience // 2)

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
        return [Event(step, "rollback", "policy_jump", message, {"value": kl, BEFORE: float(step)})]

    @property
    def reward_window(self) -> int:
        return max(1, self.config.window // 2)

    def _reward_windows(self, metrics: dict[str, Any] | None = None) -> list[tuple[int, float]]:
        """(first step, mean) of the training reward over each run of `reward_window` steps so far (`metrics` last)."""
        records = [*self.timeline.history, *([metrics] if metrics is not None else [])]
        rewards = [(r["step"], v) for r in records if (v := _num(r, "rollout/reward_mean")) is not None]
        width = self.reward_window
        return [
            (rewards[i - width][0], sum(v for _, v in rewards[i - width : i]) / width)
            for i in range(width, len(rewards) + 1)
        ]

    def _reward_shortfall(self, metrics: dict[str, Any]) -> tuple[float, float] | None:
        """The training reward's window mean now and the best such mean so far; None before there are two windows."""
        windows = self._reward_windows({**metrics, "step": metrics.get("step", self.timeline.last_step() + 1)})
        if len(windows) < 2:
            return None
        return windows[-1][1], max(mean for _, mean in windows)

    def _reward_down(self, metrics: dict[str, Any]) -> bool:
        shortfall = self._reward_shortfall(metrics)
        return shortfall is not None and shortfall[1] - shortfall[0] > self.config.length_reward_dip

    def _reward_anchor(self, windows: list[tuple[int, float]]) -> int:
        """Where a reward drop rolls back to before: the first step of the newest window still within half the margin
        of the best. Not the best window's start, which may lie far back (a run that held near its best for long
        would lose all of it) and is not among the checkpoints pruning keeps; not the falling window's, whose weights
        are already on the way down."""
        best = max(mean for _, mean in windows)
        return max(start for start, mean in windows if best - mean <= self.config.reward_drop / 2)

    def _reward_drop(self, step: int, metrics: dict[str, Any]) -> list[Event]:
        """The training reward's mean over the last `reward_window` steps against the best such mean so far."""
        if not self.config.rewards_grouped:
            return []  # without reward groups (SFT) the reward is the demonstrator's, not the policy's
        windows = self._reward_windows({**metrics, "step": step})
        if len(windows) < 2:
            return []
        now, best = windows[-1][1], max(mean for _, mean in windows)
        if best - now <= self.config.reward_drop:
            return []
        message = (
            f"step {step}: training reward {now:.3f} (mean of {self.reward_window} steps), {best - now:.3f} below its "
            f"best {best:.3f} (--health-reward-drop {self.config.reward_drop})"
        )
        values = {"value": now, "best": best, BEFORE: float(self._reward_anchor(windows))}
        return [Event(step, "rollback", "reward_drop", message, values)]

    def rollback_anchors(self) -> list[int]:
        """Every point a rule could still roll back to before, from the next step on: the next step itself (a policy
        jump, a new warning streak), the first step of each open warning streak, the reward's anchor and the last
        held-out version within the margin of the best. Later anchors only move forward, so the checkpoints these
        name are all a rollback can ask for (RollbackPolicy.needed)."""
        if not self.config.enabled:
            return []
        last = self.timeline.last_step()
        anchors = [last + 1, *(last - n + 1 for n in self._streaks.values())]
        windows = self._reward_windows()
        if windows and self.config.rewards_grouped:
            anchors.append(self._reward_anchor(windows))
        if self.timeline.evals:
            anchors.append(self._last_good_eval())
        # a rollback that would go back to a recent rollback's target goes to the checkpoint before it
        anchors += [to - 1 for to in self._recent_targets() if to > 0]
        return anchors

    def checkpoints_needed(self, checkpoints: list[int]) -> set[int]:
        """What --keep-checkpoints must not remove: every checkpoint a rule could still send the run to."""
        return self.policy.needed(checkpoints, self.rollback_anchors()) if self.config.enabled else set()

    def _recent_median(self, key: str) -> float | None:
        """The median of `key` over the last --health-window steps (a batch's length depends on what finished first in
        asynchronous modes, so a run's first batch is no yardstick for length)."""
        return recent_median(self.timeline.history, key, self.config.window)

    def _baseline(self, key: str) -> float | None:
        return starting_value(self.timeline.history, key)

    def _observe(self, step: int, metrics: dict[str, Any], events: list[Event]) -> None:
        warned = {e.rule for e in events if e.action == "warn"}
        self._streaks = {rule: self._streaks.get(rule, 0) + 1 for rule in warned}
        engine_streaks = [n for rule, n in self._streaks.items() if rule in ENGINE_RULES]
        if not engine_streaks:
            self._repushed_at = None
        if any(e.action == "repush" for e in events):
            self._repushed_at = max(engine_streaks)
        steps, applied = _num(metrics, "train/steps"), _num(metrics, "train/steps_applied")
        refused = bool(steps) and applied == 0.0
        self._observe_norm(step, _num(metrics, "train/grad_norm_max"), refused, bool(applied))
        skipped = bool(metrics.get("health/step_skipped")) or refused
        self._skipped_in_a_row = self._skipped_in_a_row + 1 if skipped else 0
        # a warning that has held since the run's first step is how this run is, not a change, and a length warning
        # with the reward up never escalates: neither keeps a checkpoint from being confirmed (else a run that
        # truncates from the start, or learns to search more, could never roll back to anything recent)
        changed = self._lasting(step, self._streaks, metrics)
        if skipped or changed or any(e.action in ("refuse", "skip") for e in events):
            self.timeline.troubled.add(step)
        self.timeline.history.append({**metrics, "step": step})

    def _observe_norm(self, step: int, norm: float | None, refused: bool, applied: bool) -> None:
        """Track refused updates in a row; an update applied after a run of them at one level makes that level the
        gradient-norm baseline's (skip_above)."""
        if refused and norm is not None:
            self._refused.append((step, norm))
            return
        if applied and len(self._refused) >= LEVEL_SHIFT_REFUSALS:
            self._level = (self._refused[0][0], {s for s, _ in self._refused})
        if applied or refused:
            self._refused = []

    def rolled_back(self, to_step: int, at_step: int) -> None:
        """The run continues from `to_step` (steps done at the checkpoint), after a rollback decided at `at_step`:
        later history is forgotten."""
        self.rollback_steps.append(at_step)
        self.rollback_targets.append(to_step)
        self.timeline.forget_from(to_step)
        self._streaks, self._skipped_in_a_row, self._refused, self._repushed_at = {}, 0, [], None
        self._drops_in_a_row = 0
        if self._level is not None and self._level[0] >= to_step:
            self._level = None

    def replay(
        self,
        records: list[dict[str, Any]],
        rollback_steps: list[int],
        grades: dict[int, list[float]] | None = None,
        rollback_targets: list[int] | None = None,
    ) -> None:
        """Rebuild the state of a resumed run from the records it kept (in file order), its rollbacks' steps and
        targets and the per-question grades of its evaluations (by version)."""
        self.rollback_steps = list(rollback_steps)
        self.rollback_targets = list(rollback_targets if rollback_targets is not None else [])
        for record in records:
            if "time/step_s" in record:
                self.review(record["step"], record)
            elif self.eval_key in record:
                self.review_eval(record["step"], record, (grades or {}).get(record["step"]))


def no_sample_cause(metrics: dict[str, Any], errors: dict[str, str]) -> str:
    """Why a rollout left nothing to train on, in words."""
    if errors:
        return "; ".join(f"{cause}: {message}" for cause, message in errors.items())
    if metrics.get("rollout/groups_dropped_zero_std"):
        return f"all {metrics['rollout/groups_dropped_zero_std']:.0f} groups were filtered for zero reward std"
    return "the rollout returned no sample"
