"""The guard replayed over a run's records, against the version its held-out metric fell."""

from benchmarks.studies.health_replay import first_drop, replay, row, summary
from slime_search.health.config import HealthConfig
from slime_search.utils.records import append_records


def records():
    base = {"time/step_s": 1.0, "train/kl_old_new": 0.01, "rollout/reward_mean": 0.5, "rollout/trainable": 8.0}
    steps = [{"step": s, **base} for s in range(6)]
    steps[3]["train/kl_old_new"] = 3.0  # an update that broke the policy
    evals = [
        {"step": v, "time/eval_s": 1.0, "eval/em": em, "eval/score": em} for v, em in [(0, 0.1), (2, 0.6), (4, 0.3)]
    ]
    return [steps[0], evals[0], steps[1], evals[1], *steps[2:4], evals[2], *steps[4:]]


def test_the_guard_replayed_fires_before_the_held_out_drop(tmp_path):
    rs = records()
    assert first_drop(rs, "eval/em", 0.2) == 4 and first_drop(rs, "eval/em", 0.4) is None
    events = replay(rs, HealthConfig())
    assert [(e.step, e.action, e.rule) for e in events] == [
        (3, "rollback", "policy_jump"),
        (4, "watch", "eval_drop"),  # one held-out fall keeps its target and waits for the next evaluation
    ]
    run = tmp_path / "run-a"
    run.mkdir()
    append_records(run / "metrics.jsonl", rs)
    s = summary(run, HealthConfig(), 0.2)
    assert s["rollback"].step == 3 and s["drop_at"] == 4
    assert row(s) == (
        "| run-a | 0.100 / 0.600 / 0.300 | version 4 | step 4 (eval_drop) | step 3 (policy_jump) | +1 | 1 | last |"
    )
    # with the run's per-question grades, a fall that is within chance (10 questions, lost and won both ways) is none
    append_records(run / "eval_grades.jsonl", [{"step": 2, "grades": [1.0] * 6 + [0.0] * 4}])
    append_records(run / "eval_grades.jsonl", [{"step": 4, "grades": [0.0] * 6 + [1.0] * 3 + [0.0]}])
    assert summary(run, HealthConfig(), 0.2)["warn"] is None


def test_the_replay_ends_on_the_best_checkpoint_after_a_late_decline(tmp_path):
    rs = records()[:-2]  # the run ends after step 3: version 4, the last evaluated, holds its final weights
    rs[1]["eval/score_high"], rs[3]["eval/score_high"], rs[6]["eval/score_high"] = 0.2, 0.7, 0.4
    events = replay(rs, HealthConfig(eval_drop=0.5, end_drop=0.1))
    assert [(e.step, e.action) for e in events] == [(3, "rollback"), (4, "end_on_best")]
    assert events[-1].values["ended_on"] == 2
    run = tmp_path / "run-b"
    run.mkdir()
    append_records(run / "metrics.jsonl", rs)
    assert row(summary(run, HealthConfig(eval_drop=0.5, end_drop=0.1), 0.2)).endswith("| step 2 |")
