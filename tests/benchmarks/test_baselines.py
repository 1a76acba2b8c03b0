"""Benchmark figures as data (benchmarks/harness/baselines.json): a figure made 30% worse than its baseline is a
regression, every baseline is of a benchmark whose smoke test checks it, and the check reads both directions."""

import json

import pytest

from benchmarks.harness.baselines import BASELINES, Baseline, load_baselines, regressions
from tests.conftest import REPO_ROOT


def worse_by(baseline: Baseline, share: float) -> float:
    """The figure `share` worse than the baseline (negative: better); a count of 0 one worse (or better)."""
    step = share * abs(baseline.value) if baseline.value else (1.0 if share > 0 else -1.0)
    return baseline.value + step if baseline.better == "lower" else baseline.value - step


@pytest.mark.parametrize("key", sorted(json.loads(BASELINES.read_text())), ids=lambda key: key.split()[0])
def test_every_figure_made_30_percent_worse_is_a_regression_and_the_baseline_itself_is_not(key):
    """`key`: the benchmark and its smoke-size arguments (a parameter named `benchmark` is pytest-benchmark's)."""
    baselines = load_baselines()[key]
    assert regressions(baselines, {name: b.value for name, b in baselines.items()}) == []
    for name, baseline in baselines.items():
        figures = {other: b.value for other, b in baselines.items()}
        figures[name] = worse_by(baseline, 0.30)
        assert regressions(baselines, figures) == [
            f"{name}: {figures[name]:g}, worse than the baseline {baseline.value:g} ({baseline.better} is better, "
            f"tolerance {baseline.tolerance:g})"
        ]
        figures[name] = worse_by(baseline, -0.30)  # better by 30%: no regression
        assert regressions(baselines, figures) == []


def test_a_figure_the_run_does_not_report_is_named():
    baselines = {"a": Baseline(1.0, "lower"), "b": Baseline(2.0, "higher")}
    assert regressions(baselines, {"a": 1.0}) == ["b: not reported"]
    with pytest.raises(ValueError, match="better lower or higher"):
        Baseline(1.0, "smaller")


def test_every_benchmark_with_baselines_is_checked_by_its_smoke_test():
    smoke_tests = "".join(path.read_text() for path in (REPO_ROOT / "tests" / "benchmarks").glob("test_*.py"))
    for key in json.loads(BASELINES.read_text()):
        assert f'check_baselines("{key}"' in smoke_tests, key
