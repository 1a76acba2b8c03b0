"""The end-of-run rule's simulation runs at its smallest size, through the real guard, and its figures mean what they
say: a deep late fall ends on an earlier checkpoint, a flat run keeps its last weights, confirmations need a pool."""

from argparse import Namespace

import numpy as np
import pytest

from benchmarks.studies import end_rule


def test_the_simulation_prints_a_row_per_fall_drop_and_confirmation(capsys):
    assert end_rule.main(["--runs", "30", "--questions", "32", "--fresh", "100", "--evals", "6"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| 0")]
    assert [(row[0], row[1], row[2]) for row in rows] == [
        (f"| {fall}", drop, confirm)
        for fall in ("0", "0.05", "0.1", "0.2")
        for drop in ("0.05", "0.1")
        for confirm in ("0", "100")
    ]
    for row in rows:
        assert 0.0 <= float(row[3]) <= 1.0 and 0.0 <= float(row[4]) <= 1.0
        assert float(row[4]) == 0.0 or row[2] == "100"  # a confirmation is spent only where it is on


def test_a_deep_late_fall_ends_earlier_and_a_flat_run_does_not():
    parsed = Namespace(runs=40, questions=64, fresh=200, evals=8, accuracy=0.9, resample=0.3, seed=1, end_drops=[0.05])
    deep = end_rule.measure(parsed, 0.5)[(0.05, 200)]
    assert deep["earlier"] >= 0.95 and deep["ended"] > deep["last"] + 0.4
    flat = end_rule.measure(parsed, 0.0)[(0.05, 0)]
    assert flat["earlier"] <= 0.1 and flat["ended"] == pytest.approx(flat["last"]) == pytest.approx(0.9)


def test_every_evaluation_grades_at_the_versions_accuracy_and_nearby_versions_alike():
    rng = np.random.default_rng(0)
    grades = end_rule.simulate(rng, 4000, [0.9, 0.9, 0.5], 0.3)
    assert [abs(g.mean() - a) < 0.03 for g, a in zip(grades, [0.9, 0.9, 0.5], strict=True)] == [True] * 3
    same = (grades[0] == grades[1]).mean()
    assert same > 0.9  # 70% kept their difficulty: far more alike than two independent 0.9s (0.82)
    independent = end_rule.simulate(rng, 4000, [0.9, 0.9], 1.0)
    assert abs((independent[0] == independent[1]).mean() - 0.82) < 0.03
    assert end_rule.accuracies(5, 0.9, 0.2, 3) == [0.9, 0.9, 0.9, 0.7, 0.7]
