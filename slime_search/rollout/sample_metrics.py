"""What a batch of samples says: the records the report shows, search behaviour, engine faults, and how stale the
tokens of an asynchronous batch were when the trainer took them."""

from __future__ import annotations

from collections import Counter
from typing import Any

from slime_search.metrics import percentile
from slime_search.rollout.rollout import reward_value
from slime_search.types import Sample, TrainSample


def sample_record(sample: Sample, reward_key: str) -> dict[str, Any]:
    """A rollout as the report shows it: prompt, the response split into generated and observed segments."""
    return {
        "prompt": sample.prompt if isinstance(sample.prompt, str) else sample.prompt[-1]["content"],
        "label": sample.label,
        "segments": [[text, generated] for text, generated in sample.segments],
        "reward": reward_value(sample.reward, reward_key) if sample.reward is not None else None,
        "status": sample.status.value,
        "searches": int(sample.metrics.get("searches", 0)),
    }


def rollout_metrics(samples: list[Sample], single_version: bool = True) -> dict[str, float]:
    """Search behaviour of a rollout: turns, searches, invalid actions, search latency, truncations, versions.
    `single_version`: a synchronous rollout must have seen one weight version (engines updated in the middle of it are
    a fault); an asynchronous batch spans versions by design (`staleness_metrics` describes them)."""
    n = max(1, len(samples))
    per_search = [
        s.metrics["search_latency_s"] / s.metrics["searches"] for s in samples if s.metrics.get("searches", 0) > 0
    ]
    out = {
        "rollout/turns_mean": sum(s.metrics.get("turns", 0) for s in samples) / n,
        "rollout/searches_mean": sum(s.metrics.get("searches", 0) for s in samples) / n,
        "rollout/search_rate": sum(s.metrics.get("searches", 0) > 0 for s in samples) / n,
        "rollout/invalid_action_rate": sum(s.metrics.get("invalid_actions", 0) > 0 for s in samples) / n,
        "rollout/obs_truncations": float(sum(s.metrics.get("obs_truncations", 0) for s in samples)),
        "rollout/search_empty": float(sum(s.metrics.get("search_empty", 0) for s in samples)),
        "rollout/search_failures": float(sum(s.metadata.get("finish_reason") == "search_error" for s in samples)),
        # every search (and page access) that answered, and the one that failed its trajectory (a failed call ends it)
        "rollout/search_calls": float(
            sum(
                s.metrics.get("searches", 0)
                + s.metrics.get("accesses", 0)
                + (s.metadata.get("finish_reason") == "search_error")
                for s in samples
            )
        ),
        "rollout/engine_errors": float(sum(s.metadata.get("finish_reason") == "engine_error" for s in samples)),
        "rollout/engine_failovers": float(sum(s.metrics.get("engine_failovers", 0) for s in samples)),
    }
    accesses = sum(s.metrics.get("accesses", 0) for s in samples)
    if accesses:  # the page-access tool (--page-access): pages read, and asked for but not held
        out["rollout/accesses_mean"] = accesses / n
        out["rollout/access_rate"] = sum(s.metrics.get("accesses", 0) > 0 for s in samples) / n
        out["rollout/access_missing"] = float(sum(s.metrics.get("access_missing", 0) for s in samples))
    billed = sum(s.metrics.get("search_billed", 0) for s in samples)
    hits = sum(s.metrics.get("search_cache_hits", 0) for s in samples)
    if billed or hits:  # web search: what the rollout cost and what a cache saved
        out["rollout/search_billed_calls"] = float(billed)
        out["rollout/search_cache_hits"] = float(hits)
        out["rollout/search_cache_hit_rate"] = hits / (billed + hits)
        out["rollout/search_cost_usd"] = float(sum(s.metrics.get("search_cost_usd", 0.0) for s in samples))
    out.update(ledger_metrics(samples, "rollout"))
    if per_search:
        out["rollout/search_latency_p50_s"] = percentile(per_search, 0.5)
        out["rollout/search_latency_p99_s"] = percentile(per_search, 0.99)
    versions = {v for s in samples for v in s.weight_versions}
    if not single_version:
        return out
    if len(versions) > 1:
        raise RuntimeError(f"a rollout mixed weight versions {sorted(versions)}; engines were updated mid-rollout")
    if versions and next(iter(versions)).isdigit():  # a scripted engine (no weights) may name its version
        out["rollout/weight_version"] = float(versions.pop())
    return out


def ledger_metrics(samples: list[Sample], prefix: str) -> dict[str, float]:
    """The run's web-search cost as a plugin's spending ledger counts it (`search_ledger_calls`, `search_ledger_usd`:
    a running total at each trajectory's end, every attempt a paid API may have billed): the newest reading."""
    out = {}
    for key in ("search_ledger_calls", "search_ledger_usd"):
        readings = [s.metrics[key] for s in samples if key in s.metrics]
        if readings:
            out[f"{prefix}/{key}"] = float(max(readings))
    return out


def staleness_metrics(samples: list[Sample], trainer_version: int) -> dict[str, float]:
    """How far behind the policy being trained (`trainer_version`) the batch was generated. A token's lag is the
    trainer's version minus the version that generated it; a trajectory's is its oldest token's. Fractions per lag
    (`async/staleness_tokens_lag_K`, `async/staleness_trajectories_lag_K`), the mean and maximum token lag, and the
    trajectories a weight push interrupted (tokens of more than one version)."""
    token_lags: Counter[int] = Counter()
    trajectory_lags: Counter[int] = Counter()
    interrupted = 0
    for sample in samples:
        versions = [v for v in sample.generated_versions() if v >= 0]
        if not versions:
            continue
        for version, count in Counter(versions).items():
            token_lags[trainer_version - version] += count
        trajectory_lags[trainer_version - min(versions)] += 1
        interrupted += len(set(versions)) > 1
    tokens, trajectories = sum(token_lags.values()), sum(trajectory_lags.values())
    out: dict[str, float] = {"async/interrupted_trajectories": float(interrupted)}
    if not tokens:
        return out
    for lag, count in sorted(token_lags.items()):
        out[f"async/staleness_tokens_lag_{lag}"] = count / tokens
    for lag, count in sorted(trajectory_lags.items()):
        out[f"async/staleness_trajectories_lag_{lag}"] = count / trajectories
    out["async/staleness_tokens_mean"] = sum(lag * count for lag, count in token_lags.items()) / tokens
    out["async/staleness_max"] = float(max(token_lags))
    return out


def mask_stale_tokens(samples: list[TrainSample], trainer_version: int, max_lag: int) -> int:
    """Take generated tokens more than `max_lag` versions older than the trainer's out of the loss; returns how many.

    Admission bounds the version a trajectory starts on, not how long it lives: a trajectory that runs through several
    pushes carries tokens as old as its start. Rather than regenerate it (which starves exactly the long, many-search
    trajectories) its too-old tokens stay in its context, as the engine generated them, and leave the loss; its newer
    tokens train as usual. A sample left with no loss token still counts in the batch's sequence count, as a fully
    masked response does."""
    masked = 0
    for sample in samples:
        versions = sample.token_versions or []
        known = [v for v in versions if v >= 0]
        if not known or trainer_version - min(known) <= max_lag:  # the common case: nothing of it is that old
            continue
        for i, version in enumerate(versions):
            if sample.loss_mask[i] and version >= 0 and trainer_version - version > max_lag:
                sample.loss_mask[i] = 0
                masked += 1
    return masked
