"""The emulated full-scale evaluation: its arithmetic, its test rows, and a run at its smallest size."""

import json
import re

import pytest

from benchmarks.perf.eval_time_emulated import FULL_QUESTIONS, estimate, main, write_sets


def test_the_estimate_scales_the_pace_per_question_to_the_seven_sets_and_the_recipes_engines():
    assert FULL_QUESTIONS == 3610 + 11313 + 14267 + 7405 + 12576 + 2417 + 125
    assert estimate(questions=1000, emulated_s=100.0, engines=2) == pytest.approx(0.1 * FULL_QUESTIONS)
    assert estimate(questions=1000, emulated_s=100.0, engines=1) == pytest.approx(0.05 * FULL_QUESTIONS)


def test_the_rows_are_search_r1_test_rows_of_the_recorded_questions(shared_data, tmp_path):
    sets = write_sets(tmp_path, limit=1005)
    assert [name for name, _ in sets] == ["nq", "triviaqa"]
    rows = [json.loads(line) for _, path in sets for line in path.read_text().splitlines()]
    assert (
        len(rows) == 1005 and rows[0]["data_source"] == "nq" and rows[-1]["extra_info"] == {"split": "test", "index": 4}
    )
    recorded = json.loads((shared_data / "trajectories" / "search_r1_3b_base_nq.jsonl").read_text().splitlines()[0])
    assert f"Question: {recorded['question']}" in rows[0]["prompt"][0]["content"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_benchmark_evaluates_a_few_recorded_questions_and_prints_its_estimate(shared_data, capsys):
    assert main(["--questions", "6", "--engines", "1", "--time-scale", "0.5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("6 questions, 1 emulated H100 engine(s)")
    assert re.search(r"seven full sets \(51713 questions\) on the recipe's 2 engines: about \d+ s", out)
