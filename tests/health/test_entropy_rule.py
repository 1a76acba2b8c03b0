"""The entropy's fall warns only with the training reward down: a policy sure of answers it gets right has learned.

The curves are the miniature's, seed 9 at lr 5e-4 (docs/benchmarks/health.md, "The entropy rule tied to the reward"):
the entropy per step as a share of its first step's, and the training reward per step. Both were learning: held-out
EM rose to 1.0 on the 64 questions drawn. Under the rule as it was, each warned `entropy_collapse` 11 times before its
first rollback; the synchronous run was rolled back and ended at 0.995 on all 600, the one-step run was stopped and
its weights scored 0.965.
"""

from __future__ import annotations

import pytest

from slime_search.health.config import HealthConfig
from slime_search.health.guard import HealthGuard

SYNCHRONOUS_REPLICA_2 = (  # rl-off-lr5e-4-rep2: ends at 0.995
    [1.00, 0.72, 0.53, 0.31, 0.11, 0.18, 0.06, 0.14, 0.08, 0.06, 0.03, 0.06, 0.04, 0.05, 0.04, 0.04, 0.05, 0.04, 0.04],
    [0.22, 0.44, 0.61, 0.78, 0.95, 0.84, 0.98, 0.78, 0.94, 0.94, 1.00, 0.94, 1.00, 0.94, 0.98, 0.94, 0.97, 0.95, 0.97],
)
ONE_STEP_REPLICA_2 = (  # rl-one-step-lr5e-4-rep2, before its first rollback: its weights then scored 0.965
    [1.00, 0.74, 0.80, 0.53, 0.20, 0.22, 0.12, 0.10, 0.07, 0.07, 0.04, 0.04, 0.05, 0.04],
    [0.09, 0.39, 0.39, 0.55, 0.86, 0.81, 0.47, 0.81, 0.91, 0.94, 0.94, 0.92, 0.89, 0.98],
)


def record(step: int, entropy: float, reward: float) -> dict:
    return {
        "step": step,
        "time/step_s": 1.0,
        "rollout/reward_mean": reward,
        "rollout/reward_std": 0.3,
        "rollout/zero_std_group_share": 0.5,
        "rollout/response_length_p90": 100.0,
        "rollout/truncation_rate": 0.0,
        "train/entropy": entropy,
        "train/grad_norm": 1.0,
        "train/grad_norm_max": 1.0,
        "train/steps": 1.0,
        "train/steps_applied": 1.0,
    }


def events_over(entropies: list[float], rewards: list[float], config: HealthConfig) -> list:
    guard = HealthGuard(config)
    events = []
    for step, (entropy, reward) in enumerate(zip(entropies, rewards, strict=True)):
        events += guard.review(step, record(step, 0.7 * entropy, reward))
    return events


@pytest.mark.parametrize("curves", [SYNCHRONOUS_REPLICA_2, ONE_STEP_REPLICA_2], ids=["off", "one-step"])
def test_a_policy_that_grows_sure_while_its_reward_rises_is_not_warned(curves):
    entropies, rewards = curves
    assert min(entropies) < HealthConfig().entropy_low  # below the bound: the rule sees the fall
    assert events_over(entropies, rewards, HealthConfig()) == []


def test_the_same_fall_with_the_reward_down_warns_and_then_rolls_back():
    """The fall of the synchronous replica, but the reward falls from its plateau of 0.95 to 0.75 as the entropy goes
    below the bound: 0.2 down is "down" and not 0.3 x the best, the reward-drop rule's margin."""
    entropies, rewards = SYNCHRONOUS_REPLICA_2
    entropies = [*entropies[:10], *[0.03] * 14]
    rewards = [*[min(r, 0.95) for r in rewards[:10]], *[0.75] * 14]
    events = events_over(entropies, rewards, HealthConfig(patience=4))
    warned = [e.step for e in events if e.action == "warn" and e.rule == "entropy_collapse"]
    rollbacks = [e for e in events if e.action == "rollback"]
    assert warned and warned[0] >= 10  # only once the reward is down
    assert rollbacks and rollbacks[0].rule == "entropy_collapse"
    assert rollbacks[0].step == warned[0] + 3  # patience 4: the fourth warning in a row


def test_an_entropy_explosion_warns_whatever_the_reward():
    entropies = [1.0, 1.0, 1.0, 4.0]
    events = events_over(entropies, [0.5, 0.6, 0.7, 0.9], HealthConfig())
    assert [(e.step, e.rule) for e in events] == [(3, "entropy_explosion")]
