"""Evaluation metrics of a set of scored rollouts, per data source and overall.

The reward plugin decides what is measured: every numeric key of the reward it returns (for Search-R1: score, em,
subem, f1, format_valid, ...) is averaged per data source; a plain float reward is reported under the reward key.
A sample that never got a reward (a failed search, an aborted generation) counts as 0 on every key. Search rate
and turns come from the generate plugin's per-sample metrics.
"""

from __future__ import annotations

from collections import defaultdict

from slime_search.types import Sample


def reward_numbers(reward: float | dict | None, reward_key: str) -> dict[str, float]:
    """The numeric entries of a reward (booleans as 0/1); a plain number is named by the reward key."""
    if reward is None:
        return {}
    if not isinstance(reward, dict):
        return {reward_key: float(reward)}
    return {key: float(value) for key, value in reward.items() if isinstance(value, (int, float))}


def evaluate_samples(samples: list[Sample], reward_key: str = "score") -> dict[str, float]:
    """Metrics per data source (metadata["data_source"]) as eval/SOURCE/KEY, and overall as eval/KEY."""
    by_source: dict[str, list[Sample]] = defaultdict(list)
    for sample in samples:
        by_source[str(sample.metadata.get("data_source") or "all")].append(sample)
    out: dict[str, float] = {}
    for source, group in [*sorted(by_source.items()), ("all", samples)]:
        prefix = "eval" if source == "all" else f"eval/{source}"
        rewards = [reward_numbers(s.reward, reward_key) for s in group]
        n = len(group)
        for key in sorted({key for numbers in rewards for key in numbers}):
            out[f"{prefix}/{key}"] = sum(numbers.get(key, 0.0) for numbers in rewards) / n
        out[f"{prefix}/search_rate"] = sum(s.metrics.get("searches", 0) > 0 for s in group) / n
        out[f"{prefix}/turns"] = sum(s.metrics.get("turns", 0) for s in group) / n
        out[f"{prefix}/n"] = float(n)
    billed = sum(s.metrics.get("search_billed", 0) for s in samples)
    hits = sum(s.metrics.get("search_cache_hits", 0) for s in samples)
    if billed or hits:  # web search: billed calls and cache hits of the whole evaluation
        out["eval/search_billed_calls"], out["eval/search_cache_hits"] = float(billed), float(hits)
        out["eval/search_cost_usd"] = float(sum(s.metrics.get("search_cost_usd", 0.0) for s in samples))
    return out
