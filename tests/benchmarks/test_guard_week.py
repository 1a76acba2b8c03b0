"""A simulated stretch of training with every fault of the week benchmark: the guard gives each its right answer, does
nothing outside them, and loses no checkpoint (the benchmark at its smallest size, through the real driver loop)."""

import json

from benchmarks import guard_week


def test_every_fault_gets_its_answer_and_nothing_else_happens(tmp_path, capsys):
    out = tmp_path / "week.json"
    assert guard_week.main(["--steps", "120", "--seeds", "3", "--json", str(out)]) == 0
    [result] = json.loads(out.read_text())
    assert set(result["faults"]) == set(guard_week.FAULTS)
    assert all(result["right_action"].values()), result
    assert result["outside_windows"] == [] and result["checkpoints_lost"] == 0 and result["stopped"] is None
    assert result["final"]["step"] == 120 and result["peak_on_disk"] <= result["budget"]
    # the lr spike's rollback, the week's only one: the redone steps sample as a second attempt, not as the undone ones
    assert result["sampling_attempt"] == 1
    assert "| 3 |" in capsys.readouterr().out


def test_the_judge_counts_a_harsher_answer_as_wrong_and_an_unrelated_action_as_a_false_alarm():
    faults = {"stale_engine": 50, "lr_spike": 80}
    events = [
        {"step": 52, "action": "warn", "rule": "logprob_gap"},
        {"step": 54, "action": "rollback", "rule": "logprob_gap"},  # the policy blamed for the engine's fault
        {"step": 80, "action": "rollback", "rule": "policy_jump"},
        {"step": 80, "action": "rollback", "rule": "policy_jump", "values": {"to_step": 70}},
        {"step": 95, "action": "warn", "rule": "entropy_collapse"},  # no fault there
    ]
    acted, outside = guard_week.classify(faults, events)
    assert outside == [(54, "rollback", "logprob_gap"), (95, "warn", "entropy_collapse")]
    assert guard_week.answered(faults, acted) == {"stale_engine": False, "lr_spike": True}
