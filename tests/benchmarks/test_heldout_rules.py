"""The held-out rule simulation runs at its smallest size, through the real guard, and its figures are shares."""

from benchmarks.studies import heldout_rules


def test_the_simulation_prints_a_row_per_rule_with_shares(capsys):
    assert heldout_rules.main(["--runs", "20", "--questions", "32", "--evals", "6", "--resample", "0.5"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 32 |")]
    assert [row.split(" | ")[3] for row in rows] == list(heldout_rules.RULES)
    for row in rows:
        alarms, caught = (float(cell) for cell in row.split(" | ")[4:6])
        assert 0.0 <= alarms <= 1.0 and 0.0 <= caught <= 1.0


def test_a_flat_run_keeps_its_accuracy_and_a_falling_one_loses_it():
    import numpy as np

    rng = np.random.default_rng(0)
    flat = heldout_rules.simulate(rng, 2000, 5, 0.3, 0.5, None, 0.0)
    falling = heldout_rules.simulate(rng, 2000, 5, 0.3, 0.5, 3, 0.3)
    assert all(abs(sum(g) / 2000 - 0.5) < 0.05 for g in flat)
    assert abs(sum(falling[4]) / 2000 - 0.2) < 0.05 and abs(sum(falling[2]) / 2000 - 0.5) < 0.05
