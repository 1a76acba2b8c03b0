"""The guard at both shapes, the simulation at its smallest size through the real guard: at the 3B recipe's shape a
healthy run is not rolled back and a held-out collapse 0.42 -> 0.25 is, within 3 evaluations; the miniature's healthy
runs are left alone too. A margin the size of the former absolute one (0.2 where EM reaches 0.42: half the best)
misses the recipe's collapse, so the table tells the bounds apart."""

import logging

import numpy as np
import pytest

from benchmarks.harness.baselines import check_baselines
from benchmarks.studies import guard_shapes
from slime_search.health.config import HealthConfig


def test_the_defaults_leave_healthy_runs_alone_and_catch_the_recipes_collapse_in_time(capsys):
    logging.disable(logging.WARNING)
    try:
        assert guard_shapes.main(["--runs", "4", "--seed", "1"]) == 0
    finally:
        logging.disable(logging.NOTSET)
    rows = {tuple(cells[1:3]): cells[3:] for line in capsys.readouterr().out.splitlines()
            if (cells := [c.strip() for c in line.split("|")])[1] in guard_shapes.SHAPES}  # fmt: skip
    assert set(rows) == {(shape, s) for shape in guard_shapes.SHAPES for s in guard_shapes.SCENARIOS}
    assert rows[("recipe", "healthy")][1] == "0" and rows[("miniature", "healthy")][1] == "0"
    runs, rolled, within, _, rules = rows[("recipe", "collapse, held-out only")][:5]
    assert (runs, rolled, within) == ("4", "4", "4") and rules == "eval_drop 4"
    assert rows[("miniature", "collapse")][1] == "4"
    figures = {}
    for (shape, scenario), cells in rows.items():
        figures[f"{shape}/{scenario}/rolled back"] = int(cells[1])
        if cells[2]:
            figures[f"{shape}/{scenario}/within 3 evaluations of the start"] = int(cells[2])
    check_baselines("guard_shapes --runs 4 --seed 1", figures)


def test_a_margin_of_half_the_best_misses_the_recipes_collapse():
    shape = guard_shapes.SHAPES["recipe"]
    loose = HealthConfig(eval_drop=0.5)
    result = guard_shapes.measure(shape, "collapse, held-out only", loose, 3, 0.3, 0)
    assert result["within"] == 0


def test_the_simulated_curves_and_collapse_have_the_shapes_they_stand_for():
    recipe = guard_shapes.SHAPES["recipe"]
    assert abs(guard_shapes.healthy(recipe, recipe.em_level, 500) - 0.42) < 0.01
    assert guard_shapes.healthy(recipe, recipe.reward_level, 0) == pytest.approx(0.1)
    level = 0.42 * guard_shapes.collapse_factor(recipe, 700, 600)
    assert abs(level - 0.25) < 1e-9 and guard_shapes.collapse_factor(recipe, 650, 600) < 1.0
    assert guard_shapes.collapse_factor(recipe, 600, 600) == 1.0
    assert guard_shapes.evaluations_until(recipe, 610, 675) == 3  # versions 625, 650, 675
    grades = guard_shapes.simulate(np.random.default_rng(0), recipe, "healthy", HealthConfig(), 0.3)
    assert grades["rollback"] is None and grades["start"] is None
