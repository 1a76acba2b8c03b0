"""The interval coverage benchmark at its smallest size: one subset size, a few draws, on a grades file it writes."""

import json
import random

from benchmarks.studies.eval_intervals import main


def test_the_coverage_table_has_a_row_per_set_and_size_and_the_average(tmp_path, capsys):
    rng = random.Random(0)
    rows = [{"source": source, "em": float(rng.random() < p)} for source, p in [("nq", 0.4), ("hotpotqa", 0.3)] * 60]
    grades = tmp_path / "run.grades.jsonl"
    grades.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main([str(grades), "--sizes", "16", "--draws", "20", "--resamples", "50"]) == 0
    out = capsys.readouterr().out
    table = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row[0].split(" (")[0] for row in table] == ["| nq", "| hotpotqa", "| average of 2 sets"]
    assert all(row[1] == "16" for row in table)
    for row in table:
        coverage, width = float(row[2]), float(row[3])
        assert 0.0 <= coverage <= 1.0 and 0.0 < width < 1.0
    assert "questions for a width of 0.10" in out
