"""Reward plugins with faults, for the end-to-end tests of what a run does about them (loaded by dotted path)."""

from slime_search.search_r1.reward import reward_func


async def nan_for_sample_3(args, sample, **kwargs):
    """Search-R1's reward, except NaN for the sample of index 3 of every group of four."""
    reward = await reward_func(args, sample, **kwargs)
    return {**reward, "score": float("nan")} if sample.index % 4 == 3 else reward


async def right_until_version_1(args, sample, **kwargs):
    """Search-R1's reward fields with a score of 1 for samples of weight versions 0 and 1 and 0 after: a policy
    that declines late, as the held-out evaluations see it."""
    reward = await reward_func(args, sample, **kwargs)
    late = any(int(version) > 1 for version in sample.weight_versions)
    return {**reward, "score": 0.0 if late else 1.0}


# The late-decline confirmation test's held-out set: EVAL_QUESTIONS questions, EVAL_SAMPLE of them graded by every
# evaluation (--eval-sample); the rest are the fresh questions a decline is confirmed on at the end.
EVAL_QUESTIONS, EVAL_SAMPLE = 16, 4


def _late_score(sample, fresh_score: float) -> float:
    """1 for weight versions 0 and 1. After: 0 on one of the graded questions (a fall of 0.25 the evaluations cannot
    tell from chance), `fresh_score` on the questions they did not grade, 1 on the rest."""
    from slime_search.evaluation.subsets import ROW_KEY, EvalSubset

    if not any(int(version) > 1 for version in sample.weight_versions):
        return 1.0
    row = sample.metadata.get(ROW_KEY)
    graded = EvalSubset(size=EVAL_SAMPLE).indices("nq", EVAL_QUESTIONS)
    if row is None or row not in graded:
        return fresh_score
    return 0.0 if row == graded[-1] else 1.0


async def declines_on_the_ungraded_questions(args, sample, **kwargs):
    reward = await reward_func(args, sample, **kwargs)
    return {**reward, "score": _late_score(sample, fresh_score=0.0)}


async def holds_on_the_ungraded_questions(args, sample, **kwargs):
    reward = await reward_func(args, sample, **kwargs)
    return {**reward, "score": _late_score(sample, fresh_score=1.0)}
