import asyncio
from types import SimpleNamespace

import pytest

from slime_search.search_r1.config import search_r1_args
from slime_search.search_r1.reward import (
    RewardConfig,
    check_format,
    em,
    extract_answer,
    f1,
    golden_answers_of,
    normalize_answer,
    qa_em_format_score,
    retrieval_hit,
    reward_func,
    subem,
)
from slime_search.types import Sample

V03 = RewardConfig.search_r1_v03()

GOOD_WITH_SEARCH = (
    "<think> I need to find the capital. </think>\n<search> capital of France </search>\n\n"
    "<information>Doc 1(Title: Paris) Paris is the capital of France.</information>\n\n"
    "<think> It is Paris. </think>\n<answer> Paris </answer>"
)
GOOD_DIRECT = "<think> I know this. </think> <answer> Paris </answer>"


def test_normalize_answer_follows_squad_rules():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("  Wilhelm Conrad Röntgen ") == "wilhelm conrad röntgen"


def test_em_subem_f1():
    assert em("the Paris", ["paris", "London"]) == 1.0
    assert em("Paris, France", "Paris") == 0.0
    assert subem("Paris, France", "Paris") == 1.0
    assert subem("Paris", "Paris, France") == 0.0
    # pred tokens [paris, france], gold [paris]: precision 1/2, recall 1 -> F1 = 2/3
    assert f1("Paris, France", ["Paris"]) == pytest.approx(2 / 3)
    # best over golden answers: "london" scores 0, "paris france" scores 1
    assert f1("Paris France", ["London", "Paris, France"]) == 1.0
    # yes/no answers score only on an exact match (FlashRAG), even when tokens overlap
    assert f1("no way", ["no"]) == 0.0
    assert f1("yes", ["yes"]) == 1.0


def test_extract_answer_reads_the_response_only():
    # Search-R1 needs >= 2 matches in prompt + response because the prompt's example answer is one; on the
    # response alone, a single answer is the answer.
    assert extract_answer("<think>x</think><answer> Paris </answer>") == "Paris"
    assert extract_answer("<answer>a</answer> then <answer> b </answer>") == "b"
    assert extract_answer("<answer> unfinished") is None
    assert extract_answer("no tags") is None


@pytest.mark.parametrize(
    "response,valid,reason",
    [
        (GOOD_WITH_SEARCH, True, "ok"),
        (GOOD_DIRECT, True, "ok"),
        (GOOD_DIRECT + "<|im_end|>", True, "ok"),
        (GOOD_DIRECT + "\n<|im_end|><|endoftext|>", True, "ok"),
        ("<answer> Paris </answer>", False, "unexpected tag <answer> in state start"),
        ("A:\n<think> x </think><answer> Paris </answer>", False, "unexpected text 'A:'"),
        (
            "<think> x </think><search> q </search><answer> y </answer>",
            False,
            "unexpected tag <answer> in state after_search",
        ),
        ("<think> x <search> q </search>", False, "unbalanced <think>"),
        ("<think> x </think>", False, "incomplete: ended in state after_think"),
        (GOOD_DIRECT + " trailing words", False, "unexpected text 'trailing words' in state end"),
        (
            "<think> a </think><search> q </search><information> d </information><answer> y </answer>",
            False,
            "unexpected tag <answer> in state information",
        ),
    ],
)
def test_format_state_machine(response, valid, reason):
    check = check_format(response)
    assert check.valid is valid
    assert reason in check.reason


def test_retrieval_hit_needs_the_answer_inside_information():
    assert retrieval_hit(GOOD_WITH_SEARCH, ["Paris"])
    assert not retrieval_hit(GOOD_WITH_SEARCH, ["Lyon"])
    assert not retrieval_hit(GOOD_DIRECT, ["Paris"])


def test_pure_em_is_the_default():
    cfg = RewardConfig()
    assert qa_em_format_score(GOOD_WITH_SEARCH, ["Paris"], cfg).score == 1.0
    assert qa_em_format_score(GOOD_WITH_SEARCH, ["Lyon"], cfg).score == 0.0
    assert qa_em_format_score("<answer> Paris </answer>", ["Paris"], cfg).score == 1.0  # malformed, still EM
    assert qa_em_format_score("just text", ["Paris"], cfg).score == 0.0


def test_search_r1_v03_format_scores_are_applied():
    # correct + well-formed: 1 ; correct + malformed: 1 - 0.2 = 0.8
    assert qa_em_format_score(GOOD_WITH_SEARCH, ["Paris"], V03).score == 1.0
    assert qa_em_format_score("<answer> Paris </answer>", ["Paris"], V03).score == pytest.approx(0.8)
    # wrong + well-formed: 0.2 ; wrong + malformed with an answer: 0.1 ; malformed without answer: 0
    assert qa_em_format_score(GOOD_WITH_SEARCH, ["Lyon"], V03).score == pytest.approx(0.2)
    assert qa_em_format_score("<answer> Lyon </answer>", ["Paris"], V03).score == pytest.approx(0.1)
    assert qa_em_format_score("no tags at all", ["Paris"], V03).score == 0.0
    # retrieval bonus: wrong answer, well-formed, the gold answer was retrieved: 0.2 + 0.1
    cfg = RewardConfig(structure_format_score=0.2, final_format_score=0.1, retrieval_score=0.1)
    wrong_but_retrieved = GOOD_WITH_SEARCH.replace("<answer> Paris </answer>", "<answer> Lyon </answer>")
    breakdown = qa_em_format_score(wrong_but_retrieved, ["Paris"], cfg)
    assert breakdown.retrieval_hit and breakdown.score == pytest.approx(0.3)


def test_answer_spam_guard():
    spam = "<think> x </think>" + "<answer> a </answer>" * 3 + "<answer> Paris </answer>"
    assert qa_em_format_score(spam, ["Paris"], RewardConfig()).score == 1.0
    guarded = qa_em_format_score(spam, ["Paris"], RewardConfig(max_answer_tags=1))
    assert guarded.score == 0.0 and guarded.answer_spam


def test_golden_answers_of_accepts_label_shapes():
    assert golden_answers_of(["a", "b"]) == ["a", "b"]
    assert golden_answers_of("a") == ["a"]
    assert golden_answers_of({"target": ["a"]}) == ["a"]
    assert golden_answers_of({"ground_truth": {"target": ["a"]}}) == ["a"]
    with pytest.raises(ValueError, match="no label"):
        golden_answers_of(None)


def test_reward_plugin_reads_flags_from_args():
    sample = Sample(response="<answer> Lyon </answer>", label={"target": ["Paris"]})
    plain = asyncio.run(reward_func(search_r1_args(), sample))
    assert plain["score"] == 0.0 and plain["answer"] == "Lyon" and not plain["format_valid"]
    shaped = asyncio.run(reward_func(search_r1_args(structure_format_score=0.2, final_format_score=0.1), sample))
    assert shaped["score"] == pytest.approx(0.1)


def test_a_flag_missing_from_the_parser_is_an_error_not_a_default():
    sample = Sample(response="<answer> Lyon </answer>", label={"target": ["Paris"]})
    with pytest.raises(AttributeError, match="--structure-format-score, --final-format-score"):
        asyncio.run(reward_func(SimpleNamespace(retrieval_score=0.0, max_answer_tags=None), sample))


def test_the_reward_config_is_built_once_per_rollout():
    """Per rollout (one event loop), not per sample: flags changed mid-rollout take effect at the next rollout."""
    args = search_r1_args(structure_format_score=0.2, final_format_score=0.1)
    sample = Sample(response="<answer> Lyon </answer>", label={"target": ["Paris"]})

    async def rollout(changed_to: float) -> list[float]:
        first = await reward_func(args, sample)
        args.final_format_score = changed_to
        second = await reward_func(args, sample)
        return [first["score"], second["score"]]

    assert asyncio.run(rollout(0.05)) == pytest.approx([0.1, 0.1])
    assert asyncio.run(rollout(0.1)) == pytest.approx([0.05, 0.05])
