"""The bad-input benchmark reads what the user saw off a run's output."""

from tests.probes.bad_inputs import CASES, NUMERIC_FLAGS, first_message, table


def test_the_line_that_ended_the_run_is_what_the_user_saw():
    output = (
        "2026 INFO step 0 em=0\n2026 health warn (truncation): step 0: 0.9 truncated\n"
        "2026 ERROR run stopped: step 1: 2 of 64 rewards were not usable\n"
    )
    assert first_message(output) == "run stopped: step 1: 2 of 64 rewards were not usable"
    assert first_message("usage: train.py ...\ntrain.py: error: argument --lr: must be >= 0, got -1\n") == (
        "error: argument --lr: must be >= 0, got -1"
    )
    assert first_message("health warn (no_reward_signal): step 0: no group's rewards differ\n").startswith("health")
    assert first_message("nothing to see") == "(none)"


def test_the_table_has_a_row_per_case_and_escapes_pipes():
    text = table([("reward NaN", {"message": "a | b", "exit": 1, "seconds": 12.34, "steps": 0})])
    assert text.splitlines()[-1] == "| reward NaN | a \\| b | 1 | 12.3 | 0 |"
    assert {"nan", "retriever-down", "retriever-dies"} <= set(CASES) and "--rollout-concurrency" in NUMERIC_FLAGS
