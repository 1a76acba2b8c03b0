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
    header, _, em_row, next_row, *_ = markdown.splitlines()
    assert em_row.startswith("| EM [95% interval about the population of questions] |")
    assert next_row.startswith("| F1 |")  # every set graded whole: no row about the sets' own (exact) EM
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
    assert comparison["unmatched"] == {"only_a": 0, "only_b": 1, "repeated_id_a": 0, "repeated_id_b": 0}
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
    assert "| EM [95% interval about the population of questions] |" in (tmp_path / "graded.table.md").read_text()
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


def width(interval):
    return interval["high"] - interval["low"]


def test_each_interval_says_what_it_is_about_and_a_subset_reads_like_its_whole_set():
    """The same 100 grades as a whole set and as a subset of 200: about the population of questions the two
    intervals are the same (so a larger graded set always reads narrower); about the set's own EM the whole set's is
    exact and the subset's is narrowed by sqrt((200 - 100) / 199)."""
    whole = rows("nq", [1.0] * 50 + [0.0] * 50)
    subset = [{**row, "set_size": 200} for row in whole]
    free, part = search_r1_table(whole), search_r1_table(subset)
    assert free["nq"]["em"] == part["nq"]["em"] and free["nq"]["em"]["about"] == "population"
    assert part["nq"]["em_set"]["about"] == free["nq"]["em_set"]["about"] == "set"
    assert free["nq"]["em_set"]["low"] == free["nq"]["em_set"]["high"] == 0.5  # all graded: the set's EM is known
    assert width(part["nq"]["em_set"]) == pytest.approx(width(part["nq"]["em"]) * (100 / 199) ** 0.5, rel=0.05)
    assert part[AVERAGE]["em"]["about"] == "population" and part[AVERAGE]["em_set"]["about"] == "set"
    assert part["nq"]["set_size"] == 200 and free["nq"]["set_size"] == 100
    markdown = table_markdown(part)
    assert "| questions | 100 of 200 |" in markdown
    set_row = next(line for line in markdown.splitlines() if "about this set's EM" in line)
    low, high = part["nq"]["em_set"]["low"], part["nq"]["em_set"]["high"]
    assert set_row.split(" | ")[1] == f"0.500 [{low:.3f}, {high:.3f}]"
    mixed = table_markdown(search_r1_table(subset + rows("popqa", [1.0, 0.0])))
    set_row = next(line for line in mixed.splitlines() if "about this set's EM" in line)
    assert set_row.split(" | ")[3] == "0.500 (exact)"  # PopQA graded whole beside a subset of NQ


def test_more_graded_questions_of_one_set_never_read_as_less_certain():
    """Grading 300 of a set of 361 and all 361 (NQ's 3,610 in miniature): about the population the full set's
    interval is the narrower, as it should be; the subset's own-set interval is the narrow one only because it is
    about a different thing, and it is labelled so."""
    grades = [float(i % 3 == 0) for i in range(361)]
    full = search_r1_table(rows("nq", grades))["nq"]
    part = search_r1_table([{**row, "set_size": 361} for row in rows("nq", grades[:300])])["nq"]
    assert width(full["em"]) < width(part["em"])
    assert width(part["em_set"]) < width(full["em"]) / 2 and part["em_set"]["about"] != full["em"]["about"]


def graded(source, ids, ems, prompts=None):
    prompts = prompts or [f"{source}-{i}" for i in ids]
    return [
        graded_row(source, prompt, {"em": em}, {}, row_id=str(i))
        for i, em, prompt in zip(ids, ems, prompts, strict=True)
    ]


def test_a_comparison_pairs_by_question_id_so_a_repeated_prompt_stays_two_questions():
    """Questions 0 and 1 share a prompt (as 14 pairs of PopQA's do) and have different answers: both are compared,
    each with its own counterpart, in whatever order the runs list them."""
    prompts = ["who?", "who?", "what?", "when?"]
    a = graded("popqa", [0, 1, 2, 3], [1.0, 0.0, 1.0, 0.0], prompts)
    b = graded("popqa", [3, 2, 1, 0], [0.0, 1.0, 1.0, 0.0], prompts[::-1])  # B lists them the other way round
    comparison = compare_runs(a, b)
    assert comparison["popqa"]["n"] == 4 and comparison["popqa"]["set_size"] == 4
    assert comparison["popqa"]["a"] == 0.5 and comparison["popqa"]["b"] == 0.5
    assert comparison["popqa"]["mean"] == pytest.approx((1 - 0) + (0 - 1) + 0 + 0) == 0.0  # (+1, -1, 0, 0) / 4
    assert comparison["unmatched"] == {"only_a": 0, "only_b": 0, "repeated_id_a": 0, "repeated_id_b": 0}
    assert comparison["prompt_differs"] == 0
    # grade files without ids: the k-th row with a prompt is that prompt's k-th question, so none is dropped
    old_a = [{**row, "id": None} for row in a]
    old_b = [{**row, "id": None} for row in graded("popqa", [0, 1, 2, 3], [0.0, 0.0, 1.0, 1.0], prompts)]
    old = compare_runs(old_a, old_b)
    assert old["popqa"]["n"] == 4 and old["popqa"]["mean"] == pytest.approx((1 + 0 + 0 - 1) / 4)


def test_a_comparison_counts_and_shows_every_question_it_cannot_pair():
    a = graded("nq", [0, 1, 1, 2, 3], [1.0, 1.0, 0.0, 1.0, 1.0])  # id 1 twice: which one to pair is a guess
    b = graded("nq", [0, 1, 2, 4], [0.0, 1.0, 1.0, 1.0], ["nq-0", "nq-1", "another prompt", "nq-4"])
    comparison = compare_runs(a, b)
    assert comparison["nq"]["n"] == 2  # ids 0 and 2
    assert comparison["unmatched"] == {"only_a": 1, "only_b": 2, "repeated_id_a": 2, "repeated_id_b": 0}
    assert comparison["prompt_differs"] == 1  # id 2 was asked differently
    text = comparison_markdown(comparison)
    assert "1 question(s) only in A, 2 only in B: left out." in text
    assert "2 row(s) of A and 0 of B share their question id" in text
    assert "1 paired question(s) were asked with different prompts" in text


def test_a_comparison_names_its_intervals_and_adds_the_whole_sets_one_for_a_subset():
    a = graded("nq", range(100), [1.0] * 60 + [0.0] * 40)
    b = graded("nq", range(100), [1.0] * 40 + [0.0] * 60)
    whole = compare_runs(a, b)
    assert whole["nq"]["about"] == "population" and whole["nq"]["set"]["about"] == "set"
    assert whole["nq"]["set"]["low"] == whole["nq"]["set"]["high"] == pytest.approx(0.2)  # all graded: exact
    header = comparison_markdown(whole).splitlines()[0]
    assert "A - B [95% paired interval about the population of questions]" in header
    assert "about this set" not in header  # nothing to add when every set was graded whole
    part = compare_runs([{**r, "set_size": 400} for r in a], b)
    assert part["nq"]["set_size"] == 400 and part["nq"]["low"] == whole["nq"]["low"]  # same estimand, same interval
    assert width(part["nq"]["set"]) < width(part["nq"])
    text = comparison_markdown(part)
    assert "about this set's em" in text.splitlines()[0] and "| 100 of 400 |" in text


def test_comparing_search_r1s_popqa_run_keeps_all_1000_questions(shared_data, tmp_path, capsys):
    """Search-R1's own PopQA trajectories hold 14 prompts asked twice, as different questions with different golden
    answers. Compared with itself listed in reverse, every question is paired with itself: 1,000 of them, no
    difference at all (pairing by prompt kept 986; pairing by position would pair different questions)."""
    path = shared_data / "trajectories" / "search_r1_3b_base_popqa.jsonl"
    lines = path.read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines]
    assert len(prompts) - len(set(prompts)) == 14  # the data this test is about
    reverse = tmp_path / "reverse.jsonl"
    reverse.write_text("\n".join(lines[::-1]) + "\n")
    out = tmp_path / "compare.json"
    assert eval_cli.main(["--compare", str(path), str(reverse), "--output", str(out)]) == 0
    comparison = json.loads(out.read_text())
    assert comparison["popqa"]["n"] == 1000 and comparison["popqa"]["low"] == comparison["popqa"]["high"] == 0.0
    assert comparison["unmatched"] == {"only_a": 0, "only_b": 0, "repeated_id_a": 0, "repeated_id_b": 0}
    assert "| PopQA | " in capsys.readouterr().out
