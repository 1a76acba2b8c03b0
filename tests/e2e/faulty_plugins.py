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
