"""Which questions an evaluation grades."""

import argparse

import pytest

from slime_search.evaluation.subsets import (
    EvalSubset,
    UngradedQuestions,
    add_eval_subset_arguments,
    eval_subset,
    fixed_subset,
)


def test_a_fixed_subset_is_the_same_per_seed_and_set_and_differs_across_them():
    first = fixed_subset(1000, 100, seed=0, name="nq")
    assert first == fixed_subset(1000, 100, seed=0, name="nq") == sorted(set(first)) and len(first) == 100
    assert first != fixed_subset(1000, 100, seed=1, name="nq")
    assert first != fixed_subset(1000, 100, seed=0, name="popqa")
    assert fixed_subset(50, 100, seed=0, name="x") == list(range(50))


def test_the_subset_is_sized_by_count_or_by_width_and_is_everything_by_default():
    assert EvalSubset().indices("nq", 7) == list(range(7))
    assert len(EvalSubset(size=100).indices("nq", 3610)) == 100
    assert EvalSubset(size=500).size_for(125) == 125  # Bamboogle has 125
    assert EvalSubset(width=0.1).size_for(3610) == 348  # 385 drawn without replacement from 3,610
    assert EvalSubset(width=0.1).size_for(125) == 95


def parse(argv):
    parser = argparse.ArgumentParser()
    add_eval_subset_arguments(parser)
    return parser.parse_args(argv)


def test_the_flags_build_the_subset_and_refuse_what_cannot_work(capsys):
    assert eval_subset(parse(["--eval-sample", "64", "--eval-sample-seed", "3"])) == EvalSubset(64, None, 3)
    assert eval_subset(parse(["--eval-interval-width", "0.05"])) == EvalSubset(None, 0.05, 0)
    for bad in (
        ["--eval-sample", "0"],
        ["--eval-interval-width", "1.5"],
        ["--eval-sample", "5", "--eval-interval-width", "0.1"],
    ):
        with pytest.raises(SystemExit):
            parse(bad)
    assert "--eval-interval-width" in capsys.readouterr().err


def test_the_ungraded_questions_are_those_the_subset_leaves_out_at_most_as_many_as_asked():
    graded = EvalSubset(size=64, seed=3)
    fresh = UngradedQuestions(graded, 100)
    rows = fresh.indices("nq", 600)
    assert len(rows) == 100 and rows == sorted(set(rows)) and not set(rows) & set(graded.indices("nq", 600))
    assert rows == UngradedQuestions(EvalSubset(size=64, seed=3), 100).indices("nq", 600)  # on every machine
    assert rows != fresh.indices("hotpotqa", 600)  # each set its own draw
    everything_left = UngradedQuestions(graded, 1000).indices("nq", 600)
    assert sorted(everything_left + graded.indices("nq", 600)) == list(range(600))
    assert UngradedQuestions(EvalSubset(size=64), 100).indices("tiny", 50) == []  # a set graded whole
