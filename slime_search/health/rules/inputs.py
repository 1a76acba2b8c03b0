"""What a step is given, checked before it can reach the loss: stop on what cannot be trusted, skip what would teach
the wrong thing, and wait out what is only passing.

    stop   rewards that are not numbers, or whose plugin raised for a fault that comes back (a bug: TypeError,
           KeyError, a 4xx answer), above --max-reward-error-rate; a plugin asking the run to stop; an actor whose
           log-probs are not finite; --max-skipped-steps skipped steps in a row; a passing fault that lasted past
           --health-max-outage-hours
    pause  more than --max-search-failure-rate of the step's searches failed (the retriever is down or overloaded), or
           more than --max-reward-error-rate of its rewards failed for a fault that passes (a reward service timing
           out, refusing connections, answering 5xx or 429: slime_search.utils.faults): the step is not trained
           (training on the trajectories that did not search teaches the policy not to search), the run waits and
           redoes the step's rollout, and a checkpoint that found the --save disk full is saved again the same way
    skip   no sample is trainable

A pause waits `backoff_s(n)` before the n-th retry of one continuous fault: 15 s, doubling to 5 minutes. A blip costs
15 s; a retriever restart (minutes: the index loads again) is met within 5 minutes of its return, a delay of a few of
the 3B recipe's 1-2 minute steps; a 6-hour outage costs about 75 retries, each a rollout that fails within its searches'
own retries. The fault's duration is measured on the run's clock (`RunParts.clock`), from the first failed try to
the try at hand; a try that succeeds ends it, and the next fault starts afresh. Past --health-max-outage-hours the run
stops, on its newest checkpoint (the weights are not at fault), and the same command resumes it (the fault may be
gone; slime_search.run.recovery).

These apply with the guard on or off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slime_search.health.config import HealthConfig
from slime_search.health.events import OUTAGE, Event
from slime_search.health.records import num

FIRST_RETRY_S = 15.0  # a passing fault's first wait
MAX_RETRY_S = 300.0  # the longest wait between two tries
RETRY_IN = "retry_in_s"  # a pause's value: seconds until the next try


def backoff_s(retry: int) -> float:
    """Seconds to wait before the `retry`-th try (0: the first retry) of a fault that passes: 15 s doubling to 300 s."""
    return min(MAX_RETRY_S, FIRST_RETRY_S * 2.0 ** min(retry, 32))


def duration(seconds: float) -> str:
    """A wait in words: seconds below two minutes, then minutes, then hours."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


@dataclass
class PassingFault:
    """One continuous fault that passes, as its tries meet it: when the first failed (on the run's clock) and how many
    retries have been waited for since. `since` is None while nothing fails."""

    config: HealthConfig
    since: float | None = None
    retries: int = 0

    def event(self, step: int, rule: str, what: str, values: dict[str, float], now: float | None) -> Event:
        """A pause while the fault has lasted less than --health-max-outage-hours (its value RETRY_IN says when to try
        again), else a stop. `now`: the run's clock (None where there is none, a replay of records: no time passes)."""
        now = 0.0 if now is None else now
        if self.since is None:
            self.since, self.retries = now, 0
        lasted, limit = now - self.since, self.config.max_outage_s
        hours = f"--health-max-outage-hours {self.config.max_outage_hours:g}"
        values = {**values, OUTAGE: lasted, "limit_s": limit}
        if lasted >= limit:
            return Event(step, "stop", rule, f"{what}; the fault has lasted {duration(lasted)}, past {hours}", values)
        retry_in = min(backoff_s(self.retries), limit - lasted)
        self.retries += 1
        message = (
            f"{what}; the step is not trained: waiting {duration(retry_in)} and trying again (try {self.retries + 1}; "
            f"the fault has lasted {duration(lasted)} so far, the run stops past {hours})"
        )
        return Event(step, "pause", rule, message, {**values, RETRY_IN: retry_in})

    def over(self) -> None:
        self.since, self.retries = None, 0


class StepInputs:
    def __init__(self, config: HealthConfig):
        self.config = config
        self.skipped_in_a_row = 0
        self.rollout_fault = PassingFault(config)  # the retriever or a reward service failing the step's rollout
        self.save_fault = PassingFault(config)  # the --save disk too full for a checkpoint

    def check_rollout(
        self, step: int, metrics: dict[str, Any], errors: dict[str, str], now: float | None = None
    ) -> list[Event]:
        """Stop on unusable rewards above their rate; pause on searches, or rewards, failing for a fault that passes
        (`now`: the run's clock, which times the fault); skip a step that has no trainable sample; warn on the samples
        lost below those bounds. A rollout without a pause ends the fault its predecessors met."""
        samples = num(metrics, "rollout/samples") or 0.0
        if errors.get("stop_run"):  # a plugin asked the run to stop (e.g. its web-search budget is spent)
            return [Event(step, "stop", "stop_run", f"step {step}: {errors['stop_run']}", {"samples": samples})]
        events: list[Event] = []
        bad_rewards = num(metrics, "rollout/reward_errors") or 0.0
        if bad_rewards:
            passing = min(bad_rewards, num(metrics, "rollout/reward_errors_transient") or 0.0)
            rate, lasting_rate = bad_rewards / max(samples, 1.0), (bad_rewards - passing) / max(samples, 1.0)
            values = {"reward_errors": bad_rewards, "transient": passing, "samples": samples, "rate": rate}
            first = errors.get("reward_error", "") or errors.get("reward_error_transient", "")
            bound = f"--max-reward-error-rate {self.config.max_reward_error_rate}"
            if lasting_rate > self.config.max_reward_error_rate:  # a bug in the plugin: a retry meets it again
                message = (
                    f"step {step}: {bad_rewards:.0f} of {samples:.0f} rewards were not usable (rate {rate:.3f} > "
                    f"{bound}); first: {errors.get('reward_error', first)}"
                )
                return [Event(step, "stop", "reward_errors", message, values)]
            if rate > self.config.max_reward_error_rate:  # the rest failed for a fault that passes
                what = (
                    f"step {step}: {bad_rewards:.0f} of {samples:.0f} rewards failed ({passing:.0f} for a fault that "
                    f"passes; rate {rate:.3f} > {bound}); first: {errors.get('reward_error_transient', first)}"
                )
                return [self.rollout_fault.event(step, "reward_errors", what, values, now)]
            events.append(Event(step, "warn", "reward_errors", f"{bad_rewards:.0f} rewards left out: {first}", values))
        bad_log_probs = num(metrics, "rollout/nonfinite_log_probs") or 0.0
        if bad_log_probs:
            message = f"{bad_log_probs:.0f} samples left out: {errors.get('nonfinite_logprob', '')}"
            events.append(Event(step, "warn", "engine_log_probs", message, {"samples": bad_log_probs}))
        calls = num(metrics, "rollout/search_calls") or 0.0
        failures = num(metrics, "rollout/search_failures") or 0.0
        if calls and failures / calls > self.config.max_search_failure_rate:
            rate = failures / calls
            what = (
                f"step {step}: {failures:.0f} of {calls:.0f} search calls failed (rate {rate:.3f} > "
                f"--max-search-failure-rate {self.config.max_search_failure_rate}); first: "
                f"{errors.get('search_error', '')}"
            )
            values = {"failures": failures, "calls": calls, "rate": rate}
            return [*events, self.rollout_fault.event(step, "search_failures", what, values, now)]
        self.rollout_fault.over()
        if not num(metrics, "rollout/trainable"):
            message = f"step {step}: no trainable sample ({no_sample_cause(metrics, errors)})"
            return [*events, self.skip(step, "no_trainable_sample", message, {"samples": samples})]
        return events

    def check_save(self, step: int, failure: str | None, now: float | None = None) -> list[Event]:
        """After a save of the checkpoint of `step` steps: `failure` says why the --save disk could not take it (None:
        saved). A pause until it can (the save is tried again), a stop past --health-max-outage-hours."""
        if failure is None:
            self.save_fault.over()
            return []
        at = max(0, step - 1)  # the step that made the weights
        return [self.save_fault.event(at, "disk_full", f"saving the checkpoint of step {step}: {failure}", {}, now)]

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
