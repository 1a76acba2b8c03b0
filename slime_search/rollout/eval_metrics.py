"""Evaluation metrics of a set of scored rollouts, per data source and overall.

The reward plugin decides what is measured: every numeric key of the reward it returns (for Search-R1: score, em, subem,
f1, format_valid, ...) is averaged per data source; a plain float reward is reported under the reward key. A sample that
never got a reward (a failed search, an aborted generation) counts as 0 on every key. Search rate and turns come from
the generate plugin's per-sample metrics. The reward key and EM (where the reward has it) come with their 95% bootstrap
interval about the population of questions, as KEY_low and KEY_high. That is the same estimand for a whole set and a
subset of it (`--eval-sample`), so the two read alike. A subset's set also gets KEY_set_low and KEY_set_high, the
interval about the whole set's own score (narrowed by the finite-population factor).
"""

from __future__ import annotations

from collections import defaultdict

from slime_search.evaluation.grading import reward_numbers
from slime_search.evaluation.intervals import bootstrap_interval
from slime_search.evaluation.subsets import set_size
from slime_search.rollout.sample_metrics import ledger_metrics
from slime_search.types import Sample

INTERVAL_KEYS = ("em",)  # besides the reward key
GRADES = "grades"  # the evaluation's per-question grades of the reward key, beside its metrics (the guard pairs them)


def question_grades(samples: list[Sample], reward_key: str = "score") -> list[float]:
    """Each question's grade of the reward key, in the eval set's order (never rewarded: 0)."""
    return [reward_numbers(s.reward, reward_key).get(reward_key, 0.0) for s in samples]


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
            if key == reward_key or key in INTERVAL_KEYS:
                values = [numbers.get(key, 0.0) for numbers in rewards]
                interval = bootstrap_interval(values)
                out[f"{prefix}/{key}_low"], out[f"{prefix}/{key}_high"] = interval.low, interval.high
                whole = None if source == "all" else set_size(group)
                if whole is not None:  # a subset of its set
                    on_set = bootstrap_interval(values, population=whole)
                    out[f"{prefix}/{key}_set_low"], out[f"{prefix}/{key}_set_high"] = on_set.low, on_set.high
        out[f"{prefix}/search_rate"] = sum(s.metrics.get("searches", 0) > 0 for s in group) / n
        out[f"{prefix}/turns"] = sum(s.metrics.get("turns", 0) for s in group) / n
        out[f"{prefix}/n"] = float(n)
    billed = sum(s.metrics.get("search_billed", 0) for s in samples)
    hits = sum(s.metrics.get("search_cache_hits", 0) for s in samples)
    if billed or hits:  # web search: billed calls and cache hits of the whole evaluation
        out["eval/search_billed_calls"], out["eval/search_cache_hits"] = float(billed), float(hits)
        out["eval/search_cost_usd"] = float(sum(s.metrics.get("search_cost_usd", 0.0) for s in samples))
    out.update(ledger_metrics(samples, "eval"))
    return out
