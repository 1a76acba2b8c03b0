"""Health signals of a batch the trainer is about to train on, from what the step already holds: the engine's
log-probs of every generated token, the trainer's (old) log-probs of the same tokens, and the weight version that
generated each token.

    logprob gap = |old - rollout| per generated token: 0 when the engine and the trainer hold the same weights and
                  agree numerically; it grows with staleness (the policy moved since the token was sampled) and
                  jumps when an engine serves other weights than it says (a failed push, a stale engine)
    IS weight   = exp(old - rollout): the truncated importance weight before its cap; the share beyond the cap is
                  the part of the batch TIS can no longer correct

Both by version lag (the trainer's version minus the token's): 0, 1 and 2 or more. Tokens whose version the engine
did not name count in the totals only. Pure functions of lists; no tensors needed at this size.
"""

from __future__ import annotations

import math
from collections import defaultdict

from slime_search.types import TrainSample

LAG_BUCKETS = ("lag0", "lag1", "lag2p")


def lag_bucket(trainer_version: int, token_version: int) -> str | None:
    if token_version < 0:
        return None
    lag = trainer_version - token_version
    return LAG_BUCKETS[min(max(lag, 0), 2)]


def batch_signals(samples: list[TrainSample], trainer_version: int, is_cap: float) -> dict[str, float]:
    """health/logprob_gap[_LAG], health/is_weight_{mean,max}, health/is_capped_share[_LAG] and
    health/nonfinite_old_log_probs over the generated (loss) tokens of samples whose old log-probs are known."""
    log_cap = math.log(is_cap)
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # bucket -> [gap sum, capped, tokens]
    weight_sum, weight_max, nonfinite = 0.0, 0.0, 0
    for sample in samples:
        if sample.old_log_probs is None or sample.rollout_log_probs is None:
            continue
        versions = sample.token_versions or [-1] * sample.response_length
        for old, rollout, mask, version in zip(
            sample.old_log_probs, sample.rollout_log_probs, sample.loss_mask, versions, strict=True
        ):
            if not mask:
                continue
            if not (math.isfinite(old) and math.isfinite(rollout)):
                nonfinite += 1
                continue
            diff = old - rollout
            weight = math.exp(min(diff, 20.0))
            weight_sum += weight
            weight_max = max(weight_max, weight)
            for bucket in ("all", lag_bucket(trainer_version, version)):
                if bucket is not None:
                    entry = sums[bucket]
                    entry[0] += abs(diff)
                    entry[1] += diff > log_cap
                    entry[2] += 1
    out = {"health/nonfinite_old_log_probs": float(nonfinite)}
    tokens = sums["all"][2] if "all" in sums else 0
    if not tokens:
        return out
    out["health/is_weight_mean"] = weight_sum / tokens
    out["health/is_weight_max"] = weight_max
    for bucket, (gap, capped, count) in sums.items():
        suffix = "" if bucket == "all" else f"_{bucket}"
        out[f"health/logprob_gap{suffix}"] = gap / count
        out[f"health/is_capped_share{suffix}"] = capped / count
        if suffix:
            out[f"health/tokens{suffix}"] = float(count)
    return out
