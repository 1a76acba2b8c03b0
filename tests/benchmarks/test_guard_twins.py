"""The guard against its unguarded twins: each unguarded run is judged by the guard replayed over its own records and
by where it ended against its seed's synchronous mean."""

import json

import pytest

from benchmarks.studies.guard_twins import compare, false_alarm_rules, main, summary_table, twin_table, verdict
from slime_search.health.config import HealthConfig
from slime_search.utils.records import append_records


def make_run(run, final, broken_step=None, rollbacks=0, last_eval=(0.5, 0.6)):
    """A run folder: 6 steps and 3 evaluations, the final weights' EM on all held-out questions, and its guard's
    completed rollbacks; `broken_step` is a step whose update broke the policy (KL 3 nats per token); `last_eval`:
    the last evaluation's EM and the upper bound of its interval (the best before it is 0.6)."""
    run.mkdir(parents=True)
    base = {"time/step_s": 1.0, "train/kl_old_new": 0.01, "rollout/reward_mean": 0.5, "rollout/trainable": 8.0}
    steps = [{"step": s, **base} for s in range(6)]
    if broken_step is not None:
        steps[broken_step]["train/kl_old_new"] = 3.0
    evals = [
        {"step": v, "time/eval_s": 1.0, "eval/em": em, "eval/score": em, "eval/score_high": high}
        for v, em, high in [(0, 0.1, 0.2), (2, 0.6, 0.7), (6, *last_eval)]
    ]
    append_records(run / "metrics.jsonl", [steps[0], evals[0], *steps[1:3], evals[1], *steps[3:], evals[2]])
    (run / "wide_eval.json").write_text(json.dumps({"eval/em": final, "eval/n": 600.0}))
    events = [{"step": 3, "action": "rollback", "rule": "policy_jump", "values": {"to_step": 2}}] * rollbacks
    (run / "health.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


@pytest.fixture
def twin_runs(tmp_path):
    guarded, unguarded = tmp_path / "g" / "seed0", tmp_path / "u" / "seed0"
    make_run(guarded / "rl-off-lr5e-4", 0.80)
    make_run(guarded / "rl-off-lr5e-4-rep1", 0.90)
    make_run(guarded / "rl-off-lr5e-4-rep2", 0.85)
    make_run(guarded / "rl-off-lr5e-4-rep3", 0.85)  # synchronous mean 0.85
    make_run(guarded / "rl-fully-lr5e-4", 0.84, rollbacks=1)
    make_run(guarded / "rl-fully-lr5e-4-rep1", 0.70)  # 0.15 below
    make_run(guarded / "rl-fully-lr5e-4-rep2", 0.85)
    make_run(guarded / "rl-fully-lr5e-4-rep3", 0.86)
    make_run(unguarded / "rl-fully-lr5e-4", 0.81, broken_step=3)  # within 0.05, yet a rollback: a false alarm
    make_run(unguarded / "rl-fully-lr5e-4-rep1", 0.60, broken_step=4)  # below, rolled back: needed
    make_run(unguarded / "rl-fully-lr5e-4-rep2", 0.79)  # below by 0.06, never rolled back: missed
    # below, and a late decline (0.6 -> 0.45, inside the eval-drop margin, beyond the end-drop one): ends on best
    make_run(unguarded / "rl-fully-lr5e-4-rep3", 0.70, last_eval=(0.45, 0.55))
    return tmp_path


def test_each_unguarded_run_is_judged_by_the_replayed_guard_and_where_it_ended(twin_runs):
    result = compare([twin_runs / "g"], [twin_runs / "u"], [0], ["fully"], 4, "5e-4", 0.05, HealthConfig())
    assert result["off"][0] == pytest.approx(0.85)
    u = result["unguarded"]
    assert [u[(0, "fully", r)]["verdict"] for r in range(4)] == ["false alarm", "needed", "missed", "ends on best"]
    assert [u[(0, "fully", r)]["rollback"].step for r in range(2)] == [3, 4]
    assert u[(0, "fully", 0)]["rollback"].rule == "policy_jump" and u[(0, "fully", 0)]["dip"] == pytest.approx(0.1)
    assert [result["guarded"][(0, "fully", r)]["below"] for r in range(4)] == [False, True, False, False]
    assert false_alarm_rules(result) == "policy_jump 1"

    table = summary_table(result, [0], ["fully"], 4, 0.05).splitlines()
    guarded, unguarded = "0.840 / 0.700 / 0.850 / 0.860 | 1 | 1", "0.810 / 0.600 / 0.790 / 0.700 | 3"
    assert table[2] == f"| 0 | fully | 0.850 | {guarded} | {unguarded} | 1 / 1 / 1 / 1 / 0 |"
    assert table[-1] == "| all | | | | 1 of 4 | 1 | | 3 of 4 | 1 / 1 / 1 / 1 / 0 |"
    rows = twin_table(result, [0], ["fully"], 4).splitlines()
    assert rows[2] == "| 0 | fully | 0 | 0.810 | -0.040 | 0.100 | step 3 (policy_jump) | 1 | false alarm | 0.840 |"
    assert rows[4].endswith("| none | 0 | missed | 0.850 |")
    assert rows[5].endswith("| none | 0 | ends on best | 0.860 |")


def test_other_bounds_replay_over_the_same_runs(twin_runs, capsys):
    assert main(["--guarded", str(twin_runs / "g"), "--unguarded", str(twin_runs / "u"), "--seeds", "0",
                 "--modes", "fully", "--replicas", "4", "--rl-lr", "5e-4", "--health-max-update-kl", "5"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "| all | | | | 1 of 4 | 1 | | 3 of 4 | 0 / 0 / 1 / 2 / 1 |" in out  # no rollback: two runs missed
    assert out.rstrip().endswith("by rule: none")


def test_the_verdicts():
    assert verdict(True, False, False) == "false alarm" and verdict(True, True, True) == "needed"
    assert verdict(False, True, True) == "ends on best" and verdict(False, True, False) == "quiet"
    assert verdict(False, False, True) == "missed" and verdict(False, False, False) == "quiet"


def test_a_run_without_its_wide_evaluation_is_named(twin_runs):
    (twin_runs / "u" / "seed0" / "rl-fully-lr5e-4-rep2" / "wide_eval.json").unlink()
    with pytest.raises(FileNotFoundError, match="rl-fully-lr5e-4-rep2: no wide_eval.json"):
        compare([twin_runs / "g"], [twin_runs / "u"], [0], ["fully"], 4, "5e-4", 0.05, HealthConfig())
