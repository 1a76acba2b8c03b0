"""The Search-R1 table and the paired comparison: on made-up grades, and on real Search-R1 3B trajectories graded as
they stand, where the table's EM must equal the original scoring rule's on the same answers."""

import json
import re
import string

import pytest

from slime_search import eval as eval_cli
from slime_search.evaluation.table import (
    AVERAGE,
    compare_runs,
    comparison_markdown,
    graded_row,
    search_r1_table,
    table_markdown,
)

TRAJECTORY_SETS = ("nq", "triviaqa", "popqa", "bamboogle")


def rows(source, ems, searches=1):
    return [graded_row(source, f"{source}-{i}", {"em": em, "f1": em}, {"searches": searches, "turns": 2}) for i, em in enumerate(ems)]  # fmt: skip


def test_the_table_has_the_papers_columns_each_set_and_the_average_of_sets():
    graded = rows("bamboogle", [1.0] * 10 + [0.0] * 10) + rows("nq", [1.0] * 90 + [0.0] * 10, searches=0) + rows("mine", [0.0] * 5)  # fmt: skip
    table = search_r1_table(graded)
    assert list(table) == ["nq", "bamboogle", "mine", AVERAGE]  # the paper's order, then others, then the average
    assert table["nq"]["em"]["mean"] == 0.9 and table["nq"]["n"] == 100 and table["nq"]["search_rate"] == 0.0
    assert table[AVERAGE]["em"]["mean"] == pytest.approx((0.9 + 0.5 + 0.0) / 3)  # each set weighs the same
    assert table[AVERAGE]["n"] == 125 and table["bamboogle"]["turns"] == 2.0
    markdown = table_markdown(table)
    header, _, em_row, *_ = markdown.splitlines()
    assert header.split(" | ")[1:] == ["NQ", "TriviaQA", "PopQA", "HotpotQA", "2wiki", "Musique", "Bamboogle", "mine", "Avg. |"]  # fmt: skip
    assert em_row.split(" | ")[2] == "-"  # TriviaQA was not evaluated
    low, high = table["nq"]["em"]["low"], table["nq"]["em"]["high"]
    assert f"0.900 [{low:.3f}, {high:.3f}]" in em_row


def test_unknown_search_counts_show_as_unknown_not_zero():
    graded = [graded_row("nq", "q", {"em": 1.0}, {})]
    table = search_r1_table(graded)
    assert table["nq"]["search_rate"] is None and table[AVERAGE]["turns"] is None
    assert "| search rate | - |" in table_markdown(table)


def test_a_comparison_pairs_questions_by_set_and_key_and_says_what_is_noise():
    a = rows("nq", [1.0] * 60 + [0.0] * 40) + rows("popqa", [1.0] * 50 + [0.0] * 50)
    b = rows("nq", [1.0] * 40 + [0.0] * 60) + rows("popqa", [1.0] * 49 + [0.0] * 51) + rows("hotpotqa", [1.0])
    comparison = compare_runs(a, b)
    assert comparison["nq"]["verdict"] == "A is better" and comparison["nq"]["mean"] == pytest.approx(0.2)
    assert comparison["popqa"]["verdict"] == "within noise"
    assert comparison[AVERAGE]["mean"] == pytest.approx((0.2 + 0.01) / 2)
    assert comparison["unmatched"] == {"only_a": 0, "only_b": 1}
    text = comparison_markdown(comparison)
    assert "| NQ | 0.600 | 0.400 | +0.200" in text and "1 only in B" in text
    with pytest.raises(ValueError, match="share no question"):
        compare_runs(rows("nq", [1.0]), rows("popqa", [1.0]))


def normalise(text):
    """SQuAD's answer normalisation, which Search-R1's EM uses: lower case, no punctuation, no articles, single
    spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def original_em(row):
    """Search-R1's qa_em rule on the same answer: the last <answer> of prompt + response once there are two (the
    prompt holds one), exact match after normalisation against any golden answer; no answer scores 0."""
    matches = re.findall(r"<answer>(.*?)</answer>", row["prompt"] + row["response"], re.DOTALL)
    if len(matches) < 2:
        return 0.0
    return float(normalise(matches[-1].strip()) in {normalise(g) for g in row["golden_answers"]})


def test_the_table_of_real_trajectories_equals_the_original_scoring(shared_data, tmp_path, capsys):
    files = [shared_data / "trajectories" / f"search_r1_3b_base_{name}.jsonl" for name in TRAJECTORY_SETS]
    assert eval_cli.main(["--grade", *map(str, files), "--output", str(tmp_path / "graded.json")]) == 0
    table = json.loads((tmp_path / "graded.table.json").read_text())
    for name, path in zip(TRAJECTORY_SETS, files, strict=True):
        trajectories = [json.loads(line) for line in path.open()]
        # the original scores an answerless response as "Beijing" (the prompt's example); no golden answer here is
        assert not any("beijing" in map(normalise, r["golden_answers"]) for r in trajectories)
        expected = sum(map(original_em, trajectories)) / len(trajectories)
        assert table[name]["em"]["mean"] == pytest.approx(expected, abs=1e-12), name
        assert table[name]["n"] == len(trajectories)
        assert table[name]["em"]["low"] < expected < table[name]["em"]["high"]
    assert 0.25 < table[AVERAGE]["em"]["mean"] < 0.35  # Search-R1 3B base (v0) on these four sets
    assert "| EM [95% interval] |" in (tmp_path / "graded.table.md").read_text()
    graded = tmp_path / "graded.grades.jsonl"
    capsys.readouterr()
    assert eval_cli.main(["--compare", str(graded), str(graded)]) == 0  # a run against itself: no difference
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(lines) == 1 + len(TRAJECTORY_SETS) + 1  # header, each set, the average
    assert all("+0.000 [+0.000, +0.000] | within noise" in line for line in lines[1:])


def test_grading_refuses_a_row_it_cannot_grade_and_names_it(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"response": "<answer> x </answer>", "dataset": "nq"}) + "\n")
    assert eval_cli.main(["--grade", str(path)]) == 1
    err = capsys.readouterr().err
    assert "bad.jsonl:1" in err and "golden answers" in err


def test_the_engine_mode_needs_its_inputs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        eval_cli.main(["--eval-prompt-data", "nq", "x.jsonl"])
    assert exit_info.value.code == 2 and "--hf-checkpoint" in capsys.readouterr().err


def test_a_subsets_rows_say_how_large_their_set_is_and_narrow_its_interval():
    whole = rows("nq", [1.0] * 50 + [0.0] * 50)
    subset = [{**row, "set_size": 200} for row in whole]
    free, narrowed = search_r1_table(whole)["nq"], search_r1_table(subset)["nq"]
    assert narrowed["em"]["high"] - narrowed["em"]["low"] < free["em"]["high"] - free["em"]["low"]
    assert narrowed["set_size"] == 200 and free["set_size"] == 100
    assert "| questions | 100 of 200 |" in table_markdown(search_r1_table(subset))
