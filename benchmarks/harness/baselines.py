"""Benchmark figures as data: the smoke-size figures of the benchmarks whose figures are counts (bytes, parameters,
simulated runs), kept in `baselines.json`, and the check that a new run of one is no worse than its baseline.

Only figures that do not depend on the machine are kept: a count is the same on every CPU, so a tolerance can be
tight enough to catch a regression of 30%. Timings are not: they differ between machines (AVX2 or AVX-512, a shared
CI machine) by more than that, so they stay in `docs/benchmarks/` with the machine named.

Each entry of `baselines.json`: `{"benchmark": {"figure": {"value": v, "better": "lower" | "higher", "tolerance":
t}}}`; a figure is worse when it is beyond `v` by more than `t` x |v| in the wrong direction (a count of 0 must
stay 0). `tests/benchmarks/test_baselines.py` runs each benchmark kept here at its smoke size and checks every figure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

BASELINES = Path(__file__).with_name("baselines.json")


@dataclass(frozen=True)
class Baseline:
    value: float
    better: str  # "lower" or "higher"
    tolerance: float = 0.05  # the relative change allowed in the worse direction

    def __post_init__(self) -> None:
        if self.better not in ("lower", "higher"):
            raise ValueError(f"a baseline is better lower or higher, not {self.better!r}")

    def worse(self, figure: float) -> bool:
        allowed = self.tolerance * abs(self.value)
        return figure > self.value + allowed if self.better == "lower" else figure < self.value - allowed


def load_baselines(path: Path = BASELINES) -> dict[str, dict[str, Baseline]]:
    return {
        benchmark: {name: Baseline(**entry) for name, entry in figures.items()}
        for benchmark, figures in json.loads(path.read_text()).items()
    }


def regressions(baselines: dict[str, Baseline], figures: dict[str, float]) -> list[str]:
    """Every figure worse than its baseline, and every baseline the run did not report, one line each."""
    lines = [f"{name}: not reported" for name in baselines if name not in figures]
    for name, baseline in baselines.items():
        if name in figures and baseline.worse(figures[name]):
            lines.append(
                f"{name}: {figures[name]:g}, worse than the baseline {baseline.value:g} ({baseline.better} is better, "
                f"tolerance {baseline.tolerance:g})"
            )
    return lines


def check_baselines(benchmark: str, figures: dict[str, float]) -> None:
    """AssertionError listing every figure of `benchmark` (its key in baselines.json: the module and its smoke-size
    arguments) worse than its baseline; a smoke test calls it with the figures it read."""
    found = regressions(load_baselines()[benchmark], figures)
    if found:
        raise AssertionError(
            f"{benchmark}: figures worse than their baselines ({BASELINES.name}):\n" + "\n".join(found)
        )
