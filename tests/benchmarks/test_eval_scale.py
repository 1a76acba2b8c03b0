"""The evaluation-at-scale benchmark at its smallest size: its synthetic runs pair question by question, and it
measures every call it names."""

import re

from benchmarks.perf.eval_scale import FULL_SETS, main, synthetic_runs


def test_the_synthetic_runs_are_the_seven_sets_with_one_id_per_question():
    a, b = synthetic_runs(scale=0.01, seed=0)
    assert len(a) == len(b) == sum(max(1, round(size * 0.01)) for _, size, _ in FULL_SETS)
    assert [(r["source"], r["id"]) for r in a] == [(r["source"], r["id"]) for r in b]
    assert len({(r["source"], r["id"]) for r in a}) == len(a)
    assert {r["source"] for r in a} == {name for name, _, _ in FULL_SETS}
    assert 0 < sum(x["em"] != y["em"] for x, y in zip(a, b, strict=True)) < len(a) / 2  # B differs on some


def test_the_benchmark_prints_a_time_and_a_peak_for_each_call(capsys):
    assert main(["--scale", "0.001"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.fullmatch(r"\| .+ \| [\d.]+ s \| [\d.]+ MiB \|", line)]
    assert len(rows) == 5 and "metrics" in rows[0] and "--compare A B" in rows[-1]
    assert out.startswith(f"{sum(max(1, round(size * 0.001)) for _, size, _ in FULL_SETS)} questions in 7 sets")
