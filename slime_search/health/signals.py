"""Health signals of a batch the trainer is about to train on, from what the step already holds. It holds the engine's
log-probs of every generated token, the trainer's (old) log-probs of the same tokens, and the weight version that
generated each token.

    logprob gap = |old - rollout| per generated token: 0 when the engine and the trainer hold the same weights and
                  agree numerically; it grows with staleness (the policy moved since the token was sampled) and
                  jumps when an engine serves other weights than it says (a failed push, a stale engine)
    IS weight   = exp(old - rollout): the truncated importance weight before its cap; the share beyond the cap is
                  the part of the batch TIS can no longer correct

Both by version lag (the trainer's version minus the token's): 0, 1 and 2 or more. Tokens whose version the engine did
not name count in the totals only. A pure function of the batch. The guard's engine rules read the tokens the trainer's
own weights sampled (health.rules.bounds): every bucket in synchronous mode, lag 0 in asynchronous modes. There a gap at
lag 1 or more is the policy having moved since, and the engines are probed instead (run.engine_check).

Under --use-mis, the statistics of the weights the loss applies (share masked, mean, extremes, ESS, mismatch KL) come
from the same two log-probs. So they are computed here over each optimizer step's whole batch. A statistic of a batch is
not the sum of its micro-batches': a mean over kept tokens, a maximum, an effective sample size.
"""

from __future__ import annotations

import math

from slime_search.algo import LOG_RATIO_BOUND, ISConfig
from slime_search.types import TrainSample


def lag_buckets(lag, known_version) -> list[tuple[str, object]]:
    """The tokens of each version-lag bucket, as boolean tensors: lag 0, 1, and 2 or more. A token whose version the
    engine did not name is in none."""
    return [
        (name, chosen & known_version) for name, chosen in (("lag0", lag <= 0), ("lag1", lag == 1), ("lag2p", lag >= 2))
    ]


def flat(values: list[list], dtype):
    """Per-sample lists of the batch end to end, as one tensor."""
    import torch

    return torch.cat([torch.tensor(v, dtype=dtype) for v in values])


def batch_signals(samples: list[TrainSample], trainer_version: int, is_cap: float) -> dict[str, float]:
    """health/logprob_gap[_LAG], health/is_weight_{mean,max}, health/is_capped_share[_LAG] and
    health/nonfinite_old_log_probs over the generated (loss) tokens of samples whose old log-probs are known. One
    pass of tensor arithmetic over the batch's tokens (a million tokens at Search-R1's scale)."""
    import torch

    known = [s for s in samples if s.old_log_probs is not None and s.rollout_log_probs is not None]
    if not known:
        return {"health/nonfinite_old_log_probs": 0.0}

    old = flat([s.old_log_probs for s in known], torch.float64)
    rollout = flat([s.rollout_log_probs for s in known], torch.float64)
    mask = flat([s.loss_mask for s in known], torch.bool)
    versions = flat([s.token_versions or [-1] * s.response_length for s in known], torch.long)
    finite = torch.isfinite(old) & torch.isfinite(rollout)
    out = {"health/nonfinite_old_log_probs": float((mask & ~finite).sum())}
    valid = mask & finite
    if not valid.any():
        return out
    diff, lag = (old - rollout)[valid], (trainer_version - versions)[valid]
    weight = torch.exp(diff.clamp(max=LOG_RATIO_BOUND))
    capped = diff > math.log(is_cap)
    out["health/is_weight_mean"] = float(weight.mean())
    out["health/is_weight_max"] = float(weight.max())
    out["health/logprob_gap"] = float(diff.abs().mean())
    out["health/is_capped_share"] = float(capped.double().mean())
    for bucket, chosen in lag_buckets(lag, versions[valid] >= 0):
        if chosen.any():
            out[f"health/logprob_gap_{bucket}"] = float(diff[chosen].abs().mean())
            out[f"health/is_capped_share_{bucket}"] = float(capped[chosen].double().mean())
            out[f"health/tokens_{bucket}"] = float(chosen.sum())
    return out


EXTREMES = {"weight_min": min, "weight_max": max}  # across a rollout's optimizer steps; every other statistic: the mean


def importance_signals(steps: list[list[TrainSample]], mis: ISConfig, trainer_version: int) -> dict[str, float]:
    """train/mis_*: the statistics of the MIS weights of each optimizer step's global batch, as the loss applies them.
    `steps` are the rollout's parts, one per optimizer step, every sample with old and rollout log-probs. The batch
    normaliser of a step is its whole batch's, as the ranks all-reduce it. Over the steps: the mean, and the least and
    largest weight. train/mis_masked_share_LAG: the share of the rollout's loss tokens of each version lag that MIS took
    out of the loss."""
    import torch

    from slime_search.algo import compute_is_weights

    per_step: list[dict[str, float]] = []
    by_lag = {name: [0.0, 0.0] for name in ("lag0", "lag1", "lag2p")}  # tokens taken out, loss tokens
    for samples in (part for part in steps if part):
        for s in samples:
            if s.old_log_probs is None or s.rollout_log_probs is None:
                raise ValueError("MIS statistics need the trainer's and the engine's log-probs of every sample")
        # float32 as the loss takes them: a weight at a mask bound falls on the same side
        old = flat([s.old_log_probs for s in samples], torch.float32)
        rollout = flat([s.rollout_log_probs for s in samples], torch.float32)
        mask = flat([s.loss_mask for s in samples], torch.float32)
        result = compute_is_weights(old, rollout, mask, [s.response_length for s in samples], mis)
        per_step.append({name: float(value) for name, value in result.metrics.items()})
        versions = flat([s.token_versions or [-1] * s.response_length for s in samples], torch.long)
        taken_out = (mask > 0) & (result.mask == 0)
        for name, chosen in lag_buckets(trainer_version - versions, versions >= 0):
            chosen = chosen & (mask > 0)
            by_lag[name][0] += float(taken_out[chosen].sum())
            by_lag[name][1] += float(chosen.sum())
    out: dict[str, float] = {}
    for name in dict.fromkeys(name for step in per_step for name in step):
        values = [step[name] for step in per_step if name in step]
        out[f"train/mis_{name}"] = EXTREMES.get(name, lambda v: sum(v) / len(v))(values)
    if per_step:  # the loss tokens the mask, the rejection and the veto took out together, whatever the mode
        out["train/mis_masked_share"] = 1.0 - out["train/mis_mask_kept_fraction"]
    for name, (taken, tokens) in by_lag.items():
        if tokens:
            out[f"train/mis_masked_share_{name}"] = taken / tokens
    return out
