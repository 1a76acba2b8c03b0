"""The training reward's rules on the run's own scale and noise: a noisy plateau is seldom "down" (which lets length
and truncation warnings speak) and never "dropped", a real fall is both, and the end rule reads the final version's
own evaluation."""

import logging
import random

import pytest

from slime_search.health.config import HealthConfig
from slime_search.health.guard import HealthGuard
from slime_search.health.rules.reward import step_noise
from tests.health.test_guard import step_record

TRUNCATING = {"rollout/truncation_rate": 0.6}  # 0.5 above the first step's 0.1: warns whenever the reward is down


def truncation_warnings(rewards: list[float]) -> list[int]:
    """The steps at which the truncation rule warned: those the guard counted the reward as down at."""
    guard, warned = HealthGuard(HealthConfig()), []
    for step, reward in enumerate(rewards):
        extra = TRUNCATING if step else {}
        events = guard.review(step, step_record(step, reward=reward, **extra))
        warned += [step for e in events if e.rule == "truncation" and e.action == "warn"]
    return warned


def test_a_noisy_plateau_is_seldom_down_and_a_fall_of_0_15_is():
    """The 3B recipe's per-step reward noise (sd 0.05, 32 prompts x 8 samples) on a plateau at 0.45, ten seeds of 300
    steps: against the best window of the whole run it counted as down on 219 of 300 steps; against the recent best
    and beyond the windows' own noise, on 18 of 3,000 here (at most 9 of a run's 300). A fall of 0.15 counts on 122
    of the 130 steps 3-15 after it (the 5-step window has mostly fallen by then)."""
    plateau_down, fall_down = [], []
    for seed in range(10):
        rng = random.Random(seed)
        plateau = [0.45 + rng.gauss(0, 0.05) for _ in range(300)]
        plateau_down.append(len(truncation_warnings(plateau)))
        fallen = [r - 0.15 if step >= 150 else r for step, r in enumerate(plateau)]
        fall_down.append(len(set(truncation_warnings(fallen)) & set(range(153, 166))))
    assert sum(plateau_down) <= 0.01 * 3000 and max(plateau_down) <= 0.04 * 300
    assert sum(fall_down) >= 0.85 * 130


def test_a_recipe_plateau_never_drops_and_its_collapse_does():
    """1,000 steps of the recipe's training reward (0.1 -> 0.4, sd 0.05 a step): the best of ~200 windows is high by
    chance, and 0.3 x the best alone would roll back there; the margin beyond chance keeps it from it. A collapse to
    0.25 is rolled back."""
    for seed in range(3):
        rng = random.Random(seed)
        guard = HealthGuard(HealthConfig())
        for step in range(1000):
            reward = 0.4 - 0.3 * 0.99**step + rng.gauss(0, 0.05)
            events = guard.review(step, step_record(step, reward=reward))
            assert not [e for e in events if e.rule == "reward_drop"], (seed, step)
    collapsing = HealthGuard(HealthConfig())
    drops = []
    for step in range(700):
        level = 0.4 if step < 500 else max(0.25, 0.4 - 0.0015 * (step - 500))
        events = collapsing.review(step, step_record(step, reward=level + rng.gauss(0, 0.05)))
        drops += [e for e in events if e.rule == "reward_drop"]
    assert drops and 500 < drops[0].step < 620
    assert 0.1 < drops[0].values["margin"] < 0.2  # 0.3 x a best near 0.45, or the noise of the best of many windows


def test_the_noise_is_read_from_the_run_and_not_from_a_steady_trend():
    rng = random.Random(0)
    noisy = [0.4 + rng.gauss(0, 0.05) for _ in range(50)]
    assert 0.05 < step_noise(noisy) < 0.12  # an upper bound of 0.05: the estimate, raised for the 48 values it has
    assert step_noise([0.8 - 0.006 * s for s in range(50)]) == pytest.approx(0.0, abs=1e-9)
    assert step_noise([0.5, 0.6]) == 0.0  # too few values to say


def late_decline_guard(evaluated_versions):
    """20 steps, evaluations every 2 versions; the held-out metric held 0.98 to version 14, then 0.86."""
    guard = HealthGuard(HealthConfig(end_drop=0.05, eval_drop=0.2))
    for step in range(20):
        guard.review(step, step_record(step))
    for version in evaluated_versions:
        score = 0.98 if version <= 14 else 0.86
        guard.review_eval(version, {"eval/score": score, "eval/score_high": score + 0.05})
    return guard


def test_the_end_rule_acts_only_on_the_final_versions_own_evaluation(caplog):
    """Beside training the final version's evaluation may not arrive (failed, or evaluation switched itself off): the
    last one that did (version 18's, 0.12 below the best) says nothing of the final weights (version 20)."""
    checkpoints = list(range(0, 21, 2))
    missing = late_decline_guard(range(0, 20, 2))
    assert missing.final_version() == 20
    with caplog.at_level(logging.WARNING, logger="slime_search.health.rules.end"):
        assert missing.end_on_best(checkpoints) is None
    assert "the final version 20 has no held-out evaluation (the last one graded version 18)" in caplog.text
    assert missing.end_candidate(checkpoints) is None
    assert missing.end_on_confirmed(14, [1.0] * 40, [0.0] * 40) is None
    # the final version evaluated: the late decline ends the run on the best checkpoint
    event = late_decline_guard(range(0, 21, 2)).end_on_best(checkpoints)
    assert event.values["ended_on"] == 14.0 and event.step == 20
    # results arriving out of order: version 18's (0.98) after the final one's (0.86): the final version's is judged
    reordered = late_decline_guard([*range(0, 15, 2), 20])
    reordered.review_eval(18, {"eval/score": 0.98, "eval/score_high": 1.0})
    event = reordered.end_on_best(checkpoints)
    assert event.values["value"] == pytest.approx(0.86) and event.values["ended_on"] == 18.0
    recovered = late_decline_guard([*range(0, 17, 2), 18])
    recovered.review_eval(20, {"eval/score": 0.98, "eval/score_high": 1.0})  # the final weights recovered
    assert recovered.end_on_best(checkpoints) is None and recovered.end_candidate(checkpoints) is None


def test_the_flags_defaults_are_the_configs():
    """A bound's default is declared twice, as a flag and as a field: the guard's simulations build the config from
    the flags, the tests from the fields; both must be the same guard."""
    import argparse

    from slime_search.health.config import add_health_arguments, health_config

    parser = argparse.ArgumentParser()
    add_health_arguments(parser)
    assert health_config(parser.parse_args([])) == HealthConfig()
