"""Importance weights that correct for the rollout engine's sampling distribution differing from the trainer's.

The rollout engine (SGLang) and the trainer (Megatron) compute slightly different probabilities for the same
tokens (kernels, precision, batching). Two corrections are offered:

- vanilla TIS: w = clamp(exp(logp_old - logp_rollout), 0, C) per token (truncated importance sampling);
- MIS, the general form. The log-ratio is taken per token, per sequence (sum) or as a geometric mean
  (per-sequence mean). It is then truncated to [0, U], clipped to [L, U], or used as a mask: tokens outside
  [L, U] leave the loss. Rejection sampling is optional and has its own level and bounds. A veto drops any
  sequence with a catastrophically unlikely token. The weights can be normalised to mean 1.

Normalisation must see the whole global batch, not one micro-batch. The weights depend only on the old and
rollout log-probs. So the trainer computes them once per step and all-reduces `is_batch_stats` across ranks.
It passes the result as `normalize_with`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from slime_search.algo.reductions import masked_mean, per_sequence_means, per_sequence_sums, segment_ids

IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "clip", "mask")
# exp() of a log-ratio beyond this overflows float32 or is meaningless (verl bounds it the same way; slime does not).
LOG_RATIO_BOUND = 20.0


@dataclass(frozen=True)
class ISConfig:
    level: str = "token"
    mode: str = "truncate"
    upper: float = 2.0
    lower: float | None = None  # defaults to 1 / upper
    rejection: bool = False
    rs_level: str | None = None  # defaults to level
    rs_lower: float | None = None  # defaults to the IS lower bound
    rs_upper: float | None = None  # defaults to the IS upper bound
    veto_threshold: float | None = None  # a token with ratio below this vetoes its whole sequence
    batch_normalize: bool = False

    def __post_init__(self) -> None:
        for name, value, valid in (
            ("level", self.level, IS_LEVELS),
            ("rs_level", self.rs_level or self.level, IS_LEVELS),
            ("mode", self.mode, IS_MODES),
        ):
            if value not in valid:
                raise ValueError(f"unknown importance-sampling {name} {value!r}; valid: {', '.join(valid)}")
        if self.upper <= 0:
            raise ValueError(f"upper bound must be > 0, got {self.upper}")
        if self.is_lower >= self.upper:
            raise ValueError(f"lower bound {self.is_lower} must be below upper bound {self.upper}")
        if self.rejection and self.rs_bounds[0] >= self.rs_bounds[1]:
            raise ValueError(f"rejection bounds {self.rs_bounds} must satisfy lower < upper")
        if self.veto_threshold is not None and self.veto_threshold <= 0:
            raise ValueError(f"veto_threshold must be > 0, got {self.veto_threshold}")

    @property
    def is_lower(self) -> float:
        return self.lower if self.lower is not None else 1.0 / self.upper

    @property
    def rs_bounds(self) -> tuple[float, float]:
        lower = self.rs_lower if self.rs_lower is not None else self.is_lower
        upper = self.rs_upper if self.rs_upper is not None else self.upper
        return lower, upper


class ISResult(NamedTuple):
    weights: torch.Tensor  # per token, detached, 0 where the original mask is 0
    mask: torch.Tensor  # the loss mask after masking / rejection / veto
    metrics: dict[str, torch.Tensor]  # scalars


def vanilla_tis_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, cap: float) -> torch.Tensor:
    """w = clamp(exp(logp_old - logp_rollout), 0, cap), detached."""
    if cap <= 0:
        raise ValueError(f"TIS cap must be > 0, got {cap}")
    log_ratio = (old_log_probs - rollout_log_probs).detach().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.exp(log_ratio).clamp(0.0, cap)


def _level_log_ratio(diff: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, level: str) -> torch.Tensor:
    if level == "token":
        return diff
    seg = segment_ids(lengths, device=diff.device)
    if level == "sequence":
        return per_sequence_sums(diff, mask, lengths)[seg]
    return per_sequence_means(diff, mask, lengths)[seg]  # geometric


def _valid_extremes(weights: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of the weights where valid, 0 and 0 when none is; computed on the weights' device without a
    host round trip (a data-dependent branch or boolean index would wait for the GPU)."""
    inf = torch.tensor(float("inf"), dtype=weights.dtype, device=weights.device)
    zero = torch.zeros((), dtype=weights.dtype, device=weights.device)
    any_valid = valid.any()
    low = torch.where(valid, weights, inf).amin() if weights.numel() else zero
    high = torch.where(valid, weights, -inf).amax() if weights.numel() else zero
    return torch.where(any_valid, low, zero), torch.where(any_valid, high, zero)


def _fraction(flags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(flags.to(mask.dtype), mask)


def mismatch_metrics(
    train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the trainer's and the engine's distributions are apart (logged whether or not IS is on)."""
    log_ratio = train_log_probs - rollout_log_probs
    train_mean = per_sequence_means(train_log_probs, mask, lengths)
    rollout_mean = per_sequence_means(rollout_log_probs, mask, lengths)
    seq_log_ratio = per_sequence_sums(log_ratio, mask, lengths).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    rho = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    return {
        "training_ppl": torch.exp(-train_mean).mean(),
        "rollout_ppl": torch.exp(-rollout_mean).mean(),
        "log_ppl_diff": (rollout_mean - train_mean).mean(),
        "kl": masked_mean(rollout_log_probs - train_log_probs, mask),
        "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1.0, mask),
        "chi2_token": masked_mean(rho.square(), mask) - 1.0,
        "chi2_seq": (torch.exp(2.0 * seq_log_ratio) - 1.0).mean(),
    }


def is_batch_stats(weights: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor | list[int], level: str):
    """(sum, count) whose ratio is the mean weight; sum these across micro-batches and ranks before normalising.

    Token level: the mean over valid tokens. Sequence and geometric levels: the mean over sequences with at
    least one valid token (each sequence carries one weight).
    """
    if level == "token":
        return torch.stack([(weights * mask).sum(), mask.sum()])
    counts = per_sequence_sums(torch.ones_like(weights), mask, lengths)
    seq_weights = per_sequence_means(weights, mask, lengths)
    valid = (counts > 0).to(weights.dtype)
    return torch.stack([(seq_weights * valid).sum(), valid.sum()])


def _effective_sample_size(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Normalised ESS = (sum w)^2 / (n * sum w^2), in (0, 1]; 1 means uniform weights."""
    w = weights * mask
    n = mask.sum().clamp_min(1)
    return w.sum().square() / (n * w.square().sum()).clamp_min(1e-12)


def compute_is_weights(
    train_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor | list[int],
    config: ISConfig,
    normalize_with: torch.Tensor | None = None,
) -> ISResult:
    """Importance weights of the trainer's (old) policy against the rollout policy, over packed sequences.

    `normalize_with` is the (sum, count) of `is_batch_stats` over the global batch; without it, a batch
    normalisation uses this call's batch.
    """
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    mask = loss_mask.to(train_log_probs.dtype)
    train_log_probs = train_log_probs.detach()
    rollout_log_probs = rollout_log_probs.detach()
    metrics = mismatch_metrics(train_log_probs, rollout_log_probs, mask, lengths)

    diff = train_log_probs - rollout_log_probs
    log_ratio = _level_log_ratio(diff, mask, lengths, config.level)
    raw = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    metrics["weight_mean_before_bound"] = masked_mean(raw, mask)
    new_mask = mask.clone()
    lower, upper = config.is_lower, config.upper
    if config.mode == "truncate":
        metrics["truncate_fraction"] = _fraction(raw > upper, mask)
        weights = raw.clamp(0.0, upper)
    elif config.mode == "clip":
        metrics["clip_fraction_low"] = _fraction(raw < lower, mask)
        metrics["clip_fraction_high"] = _fraction(raw > upper, mask)
        weights = raw.clamp(lower, upper)
    else:  # mask
        metrics["mask_fraction_low"] = _fraction(raw < lower, mask)
        metrics["mask_fraction_high"] = _fraction(raw > upper, mask)
        new_mask = new_mask * ((raw >= lower) & (raw <= upper)).to(mask.dtype)
        weights = raw
    weights = weights * mask

    if config.rejection:
        rs_level = config.rs_level or config.level
        rs_log_ratio = log_ratio if rs_level == config.level else _level_log_ratio(diff, mask, lengths, rs_level)
        rs_ratio = torch.exp(rs_log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        rs_lower, rs_upper = config.rs_bounds
        metrics["rs_fraction_low"] = _fraction(rs_ratio < rs_lower, mask)
        metrics["rs_fraction_high"] = _fraction(rs_ratio > rs_upper, mask)
        new_mask = new_mask * ((rs_ratio >= rs_lower) & (rs_ratio <= rs_upper)).to(mask.dtype)

    if config.veto_threshold is not None:
        catastrophic = ((diff < math.log(config.veto_threshold)) & (mask > 0)).to(mask.dtype)
        seq_has = per_sequence_sums(catastrophic, torch.ones_like(mask), lengths) > 0
        metrics["catastrophic_token_fraction"] = masked_mean(catastrophic, mask)
        metrics["catastrophic_seq_fraction"] = seq_has.to(mask.dtype).mean()
        new_mask = new_mask * (~seq_has)[segment_ids(lengths, device=mask.device)].to(mask.dtype)

    if config.batch_normalize:
        # Normalise over the tokens that will enter the loss (the mask after rejection), so that the weights
        # that actually multiply the loss average to one.
        stats = (
            normalize_with if normalize_with is not None else is_batch_stats(weights, new_mask, lengths, config.level)
        )
        mean_weight = stats[0] / stats[1].clamp_min(1)
        # chosen on the device: a Python branch would wait for the GPU on every micro-batch
        factor = torch.where(mean_weight > 1e-8, mean_weight, torch.ones_like(mean_weight))
        weights = weights / factor
        metrics["batch_norm_factor"] = factor

    metrics["mask_kept_fraction"] = masked_mean(new_mask, mask)
    metrics["weight_mean"] = masked_mean(weights, new_mask)
    metrics["weight_min"], metrics["weight_max"] = _valid_extremes(weights, new_mask > 0)
    metrics["ess"] = _effective_sample_size(weights, new_mask)
    return ISResult(weights.detach(), new_mask.detach(), {k: v.detach() for k, v in metrics.items()})
