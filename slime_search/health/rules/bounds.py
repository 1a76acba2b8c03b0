"""Signals beyond their bounds: the step's warnings, and the one update that moved the policy so far it broke it.

    entropy_collapse | explosion  the policy's entropy below --health-entropy-low or above --health-entropy-high x its
                                  value at the run's first step
    logprob_gap, is_weight_tail   the trainer-engine log-prob gap, the share of importance weights beyond the cap, of
                                  the tokens sampled by the weights the trainer holds (`current_value`)
    length_blowup, truncation     p90 response length x its recent median, truncations above their start
    likelihood_displacement       rewarded tokens losing log-prob in the update
    no_reward_signal              no group's rewards differ
    policy_jump                   one update moved the policy more than --health-max-update-kl: a rollback at once

Each rule applies where its signal means something. With a demonstrator engine (SFT), the trainer-engine gap and the
importance weights compare two different models, so they are not read. The entropy's fall, length and truncation
speak only while the training reward is down as well (health.rules.reward). Longer answers with the reward up are a
policy that learns to search more. A policy sure of its answers with the reward up is one that learned them: healthy
runs of the miniature end at 0.03-0.06 x their first step's entropy with held-out EM near 1.0.

The engine rules compare the engine with the trainer only where both held the same weights. A token sampled one or two
versions back differs from the trainer's log-prob because the policy moved since, not because an engine is wrong
(docs/benchmarks/health.md, "The engine probe"). In synchronous mode every token is the current weights'. In
asynchronous modes only the tokens of version lag 0 are, and there may be none after step 0. So the engines are
probed every --health-patience steps instead (run.engine_check).
"""

from __future__ import annotations

from typing import Any

from slime_search.health.config import HealthConfig
from slime_search.health.events import BEFORE, Event
from slime_search.health.records import num, recent_median, starting_value

# a sign of trouble only with the training reward down too: a policy that grows sure of its answers, or longer, while
# its reward holds or rises is one that learned (docs/benchmarks/health.md, "The entropy rule tied to the reward")
REWARD_GATED_RULES = ("entropy_collapse", "length_blowup", "truncation")
ENGINE_RULES = ("logprob_gap", "is_weight_tail")  # compare the trainer with the engine that sampled


def current_value(metrics: dict[str, Any], signal: str, synchronous: bool) -> tuple[str, float] | None:
    """(key, value) of the worst of `signal` (health.signals: the whole batch's, and by version lag) over the tokens
    sampled by the weights the trainer holds. In synchronous mode that is every bucket, since all its tokens are, also
    those whose version the engine did not name. In asynchronous modes it is lag 0; None without one."""
    keys = [k for k in metrics if k == signal or k.startswith(f"{signal}_")] if synchronous else [f"{signal}_lag0"]
    values = [(k, v) for k in keys if (v := num(metrics, k)) is not None]
    return max(values, key=lambda kv: kv[1], default=None)


def signal_warnings(
    step: int, metrics: dict[str, Any], history: list[dict[str, Any]], c: HealthConfig, reward_down: bool
) -> list[Event]:
    """The warnings of the step's record against the run's history (its first step, its recent medians)."""
    events = []

    def warn(rule: str, message: str, **values: float) -> None:
        if rule in ENGINE_RULES and not c.engine_serves_policy:
            return  # a demonstrator engine is another model: the gap and the weights measure that, not a fault
        if rule in REWARD_GATED_RULES and not reward_down:
            return  # a surer or longer policy with its reward up learned to answer or to search more: nothing to act on
        events.append(Event(step, "warn", rule, f"step {step}: {message}", values))

    entropy, start = num(metrics, "train/entropy"), starting_value(history, "train/entropy")
    if entropy is not None and start:
        if entropy < c.entropy_low * start:
            message = f"entropy {entropy:.4g} < {c.entropy_low} x its start {start:.4g}"
            warn("entropy_collapse", message, value=entropy, start=start)
        elif entropy > c.entropy_high * start:
            message = f"entropy {entropy:.4g} > {c.entropy_high} x its start {start:.4g}"
            warn("entropy_explosion", message, value=entropy, start=start)
    gap = current_value(metrics, "health/logprob_gap", c.synchronous)
    if gap is not None and gap[1] > c.max_logprob_gap:
        warn("logprob_gap", f"{gap[0]} {gap[1]:.4g} > --health-max-logprob-gap {c.max_logprob_gap}", value=gap[1])
    capped = current_value(metrics, "health/is_capped_share", c.synchronous)
    if capped is not None and capped[1] > c.max_is_capped_share:
        message = f"{capped[1]:.3f} of tokens beyond the importance-weight cap ({capped[0]} > {c.max_is_capped_share})"
        warn("is_weight_tail", message, value=capped[1])
    # a batch's length depends on what finished first in asynchronous modes: its recent median is the yardstick
    length = num(metrics, "rollout/response_length_p90")
    usual = recent_median(history, "rollout/response_length_p90", c.window)
    if length is not None and usual and length > c.length_blowup * usual:
        message = f"p90 response length {length:.0f} > {c.length_blowup} x its recent median {usual:.0f}"
        warn("length_blowup", message, value=length, usual=usual)
    shift = num(metrics, "train/logp_shift_pos")
    if shift is not None and shift < c.min_positive_shift:
        message = (
            f"rewarded tokens lost {-shift:.3g} nats each in the update "
            f"(--health-min-positive-shift {c.min_positive_shift})"
        )
        warn("likelihood_displacement", message, value=shift)
    if c.rewards_grouped and (message := no_reward_signal(metrics, history)) is not None:
        warn("no_reward_signal", message, value=1.0)
    truncated, start = num(metrics, "rollout/truncation_rate"), starting_value(history, "rollout/truncation_rate")
    if truncated is not None and start is not None and truncated - start > c.truncation_rise:
        message = f"{truncated:.3f} of samples truncated, {c.truncation_rise} or more above its start {start:.3f}"
        warn("truncation", message, value=truncated, start=start)
    return events


def no_reward_signal(metrics: dict[str, Any], history: list[dict[str, Any]]) -> str | None:
    """Why no group's rewards differ, when that calls for a look: every sample rewarded alike (a constant reward), or
    a second step in a row with no signal. One such step of groups all right or all wrong is chance near a plateau
    (seed 8 of the miniature, 8 prompts at reward 0.88, one in 20 steps) and passes. So does one step where every
    sample earns the best reward of a run whose rewards varied before: that policy answers all its prompts."""
    if num(metrics, "rollout/zero_std_group_share") != 1.0:
        return None
    if num(metrics, "rollout/reward_std") == 0.0 and not saturated(metrics, history):
        return "every sample's reward is the same (a constant reward?): the step learns nothing"
    if history and num(history[-1], "rollout/zero_std_group_share") == 1.0:
        return "no group's rewards differ, two steps in a row: the steps learn nothing"
    return None


def saturated(metrics: dict[str, Any], history: list[dict[str, Any]]) -> bool:
    """Whether a step with every sample alike is a policy at the top of its run rather than a constant reward: earlier
    steps' rewards varied, and this step's mean is at or above each of theirs. A constant reward shows from step 0."""
    earlier = [(num(h, "rollout/reward_mean"), num(h, "rollout/reward_std")) for h in history]
    earlier = [(mean, std) for mean, std in earlier if mean is not None and std is not None]
    mean = num(metrics, "rollout/reward_mean")
    if mean is None or not any(std > 0 for _, std in earlier):
        return False
    return all(mean >= m for m, _ in earlier)


def policy_jump(step: int, metrics: dict[str, Any], c: HealthConfig) -> list[Event]:
    """One update that moved the policy this far on what it trained on broke it. At lr 1e-2 the miniature's first step
    moved it 4.6 nats a token, and it never answered again. There is no need to wait for the reward to show it."""
    kl = num(metrics, "train/kl_old_new")
    if kl is None or kl <= c.max_update_kl:
        return []
    bound = f"--health-max-update-kl {c.max_update_kl}"
    message = f"step {step}: the update moved the policy KL {kl:.3g} per token (> {bound})"
    return [Event(step, "rollback", "policy_jump", message, {"value": kl, BEFORE: float(step)})]
