"""The guard week at its smallest sizes, through the real driver loop, guard and recovery: at the 3B recipe's shape (its
own command line, intervals 20 and 25, every health default) 200 steps with nine faults of real durations, and the
miniature's week; each fault gets its right answer, nothing happens outside them, no checkpoint is lost and the disk
stays within the budget the run prints. Then the judge itself, on hand-made events."""

import json

import pytest

from benchmarks.studies import guard_week
from benchmarks.studies.guard_week.faults import faults_for
from benchmarks.studies.guard_week.shapes import SHAPES
from benchmarks.studies.guard_week.world import PASSING_S

RECIPE_FAULTS = [
    "retriever_outage",
    "reward_timeout",
    "disk_full",
    "engine_death",
    "stale_engine",
    "wrong_engine",
    "lr_spike",
    "driver_kill",
    "eval_hang",
]


def run_week(tmp_path, *flags) -> dict:
    out = tmp_path / "week.json"
    assert guard_week.main([*flags, "--json", str(out)]) == 0
    [result] = json.loads(out.read_text())
    return result


def assert_week_met_its_targets(result: dict, steps: int) -> None:
    assert all(result["right_action"].values()), (result["right_action"], result["problems"], result["acted"])
    assert result["outside_windows"] == [] and result["stops_on_passing_faults"] == []
    assert result["checkpoints_lost"] == 0 and result["checkpoints_saved"] > 0
    assert 0 < result["peak_bytes"] <= result["budget_bytes"]
    assert result["final"]["step"] == steps and result["ended"] == "done"
    assert result["met_every_target"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_recipe_shape_gets_every_fault_answered_and_loses_nothing(tmp_path):
    result = run_week(tmp_path, "--shape", "recipe", "--steps", "200", "--seeds", "1", "--faults", *RECIPE_FAULTS)
    assert set(result["faults"]) == set(RECIPE_FAULTS)
    assert_week_met_its_targets(result, 200)
    acted = {kind: {tuple(a) for a in acts} for kind, acts in result["acted"].items()}
    # passing faults are waited out, never skipped or stopped on
    assert {a for a, _ in acted["retriever_outage"]} == {"pause"} and {a for a, _ in acted["disk_full"]} == {"pause"}
    # the engine that stays wrong: re-pushed, probed, restarted, then the stop naming it, on the newest checkpoint
    assert {"repush", "probe", "restart_engine", "stop"} <= {a for a, _ in acted["wrong_engine"]}
    # checkpoints are the recipe's 43.2 GB each; the budget is the product's 2 x 2 + 4, plus one per rollback the
    # guard may still go back from (--max-rollbacks 2)
    checkpoints = result["budget_checkpoints"]
    assert checkpoints == 2 * 2 + 4 + 2 and round(result["budget_bytes"] / checkpoints / 1e9, 1) == 43.2
    # a killed driver, an engine swapped after the stop, an evaluation past its deadline: the same command again
    assert result["starts"] == 4


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_miniature_week_gets_every_fault_answered(tmp_path):
    result = run_week(tmp_path, "--shape", "miniature", "--steps", "120", "--seeds", "3")
    assert set(result["faults"]) == set(SHAPES["miniature"].default_faults)
    assert_week_met_its_targets(result, 120)
    assert result["rollbacks"] == 1  # the lr spike's, the week's only one


def test_the_world_is_not_sized_to_the_rules(tmp_path):
    from slime_search.health.config import HealthConfig

    timing, rules = SHAPES["recipe"].timing, HealthConfig()
    longest_step = timing.rollout_s[1] + timing.train_s[1]
    # a 10-minute outage outlasts the skip limit's steps, even at the longest step
    assert PASSING_S["retriever_outage"] > rules.max_skipped_steps * longest_step
    # every passing fault is over well within --health-max-outage-hours: waited out, never a stop
    assert max(PASSING_S.values()) < rules.max_outage_hours * 3600
    # the recipe's intervals, which do not divide each other (checkpoints at 20, 25, 40, 50, 60, 75, 80, ...)
    from benchmarks.studies.guard_week.shapes import setup

    config = setup("recipe", tmp_path, tmp_path / "run").config
    assert (config.save_interval, config.eval_interval, config.keep_checkpoints) == (20, 25, 2)
    assert config.health == rules


def test_the_judge_counts_a_harsher_answer_as_wrong_and_an_unrelated_action_as_a_false_alarm():
    catalogue = faults_for(beside=False, patience=4, eval_window=100)
    faults = {"stale_engine": 50, "lr_spike": 80, "retriever_outage": 120}
    events = [
        {"step": 52, "action": "warn", "rule": "logprob_gap"},
        {"step": 54, "action": "rollback", "rule": "logprob_gap"},  # the policy blamed for the engine's fault
        {"step": 80, "action": "rollback", "rule": "policy_jump"},
        {"step": 80, "action": "rollback", "rule": "policy_jump", "values": {"to_step": 70}},
        {"step": 95, "action": "warn", "rule": "entropy_collapse"},  # no fault there
        {"step": 121, "action": "skip", "rule": "search_failures"},  # a passing fault skipped, not waited out
    ]
    actions = [(130, "engine_restart", "engine_down")]  # an engine restarted with no engine fault
    met = {"retriever_outage": [120, 121]}
    acted, outside = guard_week.classify(faults, catalogue, events, actions, met, 200)
    assert outside == [
        (54, "rollback", "logprob_gap"),
        (95, "warn", "entropy_collapse"),
        (121, "skip", "search_failures"),
        (130, "engine_restart", "engine_down"),
    ]
    assert guard_week.answered(faults, catalogue, acted) == {
        "stale_engine": False,
        "lr_spike": True,
        "retriever_outage": False,
    }


def test_faults_are_placed_apart_and_a_hang_after_the_collapses_and_restarts():
    import numpy as np

    catalogue = faults_for(beside=True, patience=4, eval_window=200)
    kinds = ["slow_collapse", "fast_collapse", "driver_kill", "wrong_engine", "eval_hang", "lr_spike"]
    for seed in range(20):
        placed = guard_week.place(kinds, catalogue, np.random.default_rng(seed), 1000, first=50, tail=25)
        steps = sorted(placed.values())
        assert steps[0] >= 50 and steps[-1] <= 975 and len(set(steps)) == len(kinds)
        assert placed["eval_hang"] > max(placed[k] for k in ("slow_collapse", "fast_collapse", "driver_kill",
                                                              "wrong_engine"))  # fmt: skip
        assert placed["fast_collapse"] + catalogue["fast_collapse"].span < placed["slow_collapse"] or (
            placed["slow_collapse"] + catalogue["slow_collapse"].span < placed["fast_collapse"]
        )
