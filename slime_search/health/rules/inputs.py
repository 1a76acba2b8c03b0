"""What a step is given, checked before it can reach the loss: stop on what cannot be trusted, skip what would teach
the wrong thing.

    stop  rewards that are not numbers above --max-reward-error-rate, a plugin asking the run to stop, an actor whose
          log-probs are not finite, --max-skipped-steps skipped steps in a row
    skip  more than --max-search-failure-rate of the step's searches failed (training on the trajectories that did
          not search teaches the policy not to search), or no sample is trainable

These apply with the guard on or off.
"""

from __future__ import annotations

from typing import Any

from slime_search.health.config import HealthConfig
from slime_search.health.events import Event
from slime_search.health.records import num


class StepInputs:
    def __init__(self, config: HealthConfig):
        self.config = config
        self.skipped_in_a_row = 0

    def check_rollout(self, step: int, metrics: dict[str, Any], errors: dict[str, str]) -> list[Event]:
        """Stop on unusable rewards above their rate; skip a step whose searches failed or that has no trainable
        sample; warn on the samples lost below those bounds."""
        samples = num(metrics, "rollout/samples") or 0.0
        if errors.get("stop_run"):  # a plugin asked the run to stop (e.g. its web-search budget is spent)
            return [Event(step, "stop", "stop_run", f"step {step}: {errors['stop_run']}", {"samples": samples})]
        events: list[Event] = []
        bad_rewards = num(metrics, "rollout/reward_errors") or 0.0
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
        bad_log_probs = num(metrics, "rollout/nonfinite_log_probs") or 0.0
        if bad_log_probs:
            message = f"{bad_log_probs:.0f} samples left out: {errors.get('nonfinite_logprob', '')}"
            events.append(Event(step, "warn", "engine_log_probs", message, {"samples": bad_log_probs}))
        calls = num(metrics, "rollout/search_calls") or 0.0
        failures = num(metrics, "rollout/search_failures") or 0.0
        if calls and failures / calls > self.config.max_search_failure_rate:
            rate = failures / calls
            message = (
                f"step {step}: {failures:.0f} of {calls:.0f} search calls failed (rate {rate:.3f} > "
                f"--max-search-failure-rate {self.config.max_search_failure_rate}); first: "
                f"{errors.get('search_error', '')}"
            )
            return [*events, self.skip(step, "search_failures", message, {"failures": failures, "calls": calls})]
        if not num(metrics, "rollout/trainable"):
            message = f"step {step}: no trainable sample ({no_sample_cause(metrics, errors)})"
            return [*events, self.skip(step, "no_trainable_sample", message, {"samples": samples})]
        return events

    def check_batch(self, step: int, metrics: dict[str, Any]) -> list[Event]:
        """After the trainer's log-probs: an actor whose log-probs are not finite has non-finite weights; nothing it
        would train or save can be trusted."""
        bad = num(metrics, "health/nonfinite_old_log_probs") or 0.0
        if bad:
            message = f"step {step}: the actor's log-probs of {bad:.0f} tokens are not finite: its weights are damaged"
            return [Event(step, "stop", "nonfinite_weights", message, {"tokens": bad})]
        return []

    def skip(self, step: int, rule: str, message: str, values: dict[str, float]) -> Event:
        """A skipped step; the last one allowed in a row becomes a stop."""
        if self.skipped_in_a_row + 1 >= self.config.max_skipped_steps:
            message = f"{self.skipped_in_a_row + 1} steps in a row skipped; the last: {message}"
            return Event(step, "stop", rule, message, values)
        return Event(step, "skip", rule, message, values)

    def observe(self, skipped: bool) -> None:
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0


def no_sample_cause(metrics: dict[str, Any], errors: dict[str, str]) -> str:
    """Why a rollout left nothing to train on, in words."""
    if errors:
        return "; ".join(f"{cause}: {message}" for cause, message in errors.items())
    if metrics.get("rollout/groups_dropped_zero_std"):
        return f"all {metrics['rollout/groups_dropped_zero_std']:.0f} groups were filtered for zero reward std"
    return "the rollout returned no sample"
