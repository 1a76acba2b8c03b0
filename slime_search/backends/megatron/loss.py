"""The training loss of one packed micro-batch, from the model's logits: wiring of the pure algo functions.

Response token t of a sample is predicted by the logits one position earlier. So a sample ending at packed position e
with r response tokens reads logits[e - r - 1 : e - 1] against tokens[e - r : e].
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from slime_search.algo import (
    ISConfig,
    compute_is_weights,
    expand_to_tokens,
    is_batch_stats,
    kl_estimate,
    likelihood_preservation,
    policy_loss,
    reduce_loss,
    vanilla_tis_weights,
)
from slime_search.backends.megatron.custom_tis import call_tis_function
from slime_search.backends.megatron.logprobs import entropy, token_log_probs
from slime_search.backends.megatron.packing import PackedBatch
from slime_search.config.loss import LossConfig
from slime_search.types import TrainSample


def local_batch_counts(samples: list[TrainSample], device: torch.device) -> torch.Tensor:
    """(loss tokens, sequences) of this rank's share of the global batch, on `device`: the data-parallel group
    sums them, and on GPU that group is NCCL, which takes no CPU tensors."""
    tokens = sum(sum(s.loss_mask) for s in samples)
    return torch.tensor([tokens, len(samples)], dtype=torch.float64, device=device)


def local_mis_stats(samples: list[TrainSample], mis: ISConfig, device: torch.device) -> torch.Tensor:
    """(sum, count) of this rank's raw MIS weights, on `device`, for the data-parallel group to sum."""
    import dataclasses

    if not samples:  # a data-parallel rank with no sample of this step
        return torch.zeros(2, dtype=torch.float64, device=device)
    raw = dataclasses.replace(mis, batch_normalize=False)
    lengths = [s.response_length for s in samples]
    old = torch.tensor([x for s in samples for x in s.old_log_probs], device=device)
    rollout = torch.tensor([x for s in samples for x in s.rollout_log_probs], device=device)
    mask = torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.float32, device=device)
    result = compute_is_weights(old, rollout, mask, lengths, raw)
    return is_batch_stats(result.weights, result.mask, lengths, mis.level).double()


def response_logits_and_targets(logits: torch.Tensor, packed: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits rows predicting every response token of the micro-batch, and those tokens, concatenated; the tokens
    on the logits' device (the packed batch stays where it was built)."""
    rows = [logits[0, s.start - 1 : s.stop - 1] for s in packed.response_slices()]
    targets = [packed.input_ids[0, s] for s in packed.response_slices()]
    return torch.cat(rows), torch.cat(targets).to(logits.device)


def _packed(
    values: list[list[float] | None], samples: list[TrainSample], name: str, device: torch.device
) -> torch.Tensor:
    if any(v is None for v in values):
        raise ValueError(f"{name} missing for some samples")
    for v, s in zip(values, samples, strict=True):
        if len(v) != s.response_length:
            raise ValueError(f"{name} has {len(v)} entries for a response of {s.response_length} tokens")
    return torch.tensor([x for v in values for x in v], dtype=torch.float32, device=device)


def micro_batch_loss(
    logits: torch.Tensor,
    packed: PackedBatch,
    samples: list[TrainSample],
    config: LossConfig,
    num_tokens: float,
    num_sequences: int,
    is_normalizer: torch.Tensor | None = None,
    tis_function: Callable[..., Any] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of this micro-batch normalised by the *global* token / sequence counts, so that summing the
    micro-batch losses of a step gives the loss of the whole batch; plus detached metric tensors.

    `is_normalizer`: the (sum, count) of MIS weights over the global batch, for batch normalisation.
    `tis_function`: `config.custom_tis` loaded (CustomTIS.load), called on the micro-batch as slime's loss calls it.
    Every tensor built here (mask, advantages, old / rollout / reference log-probs) goes on the logits' device.
    """
    device = logits.device
    rows, targets = response_logits_and_targets(logits, packed)
    log_probs = token_log_probs(rows, targets, config.temperature, config.vocab_size)
    lengths = packed.response_lengths
    mask = torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.float32, device=device)
    reduce = dict(num_tokens=num_tokens, num_sequences=num_sequences)
    metrics: dict[str, torch.Tensor] = {}
    if config.loss_type == "sft":
        loss = reduce_loss(-log_probs, mask, lengths, config.reduction, **reduce)
        return loss, {"sft_loss": loss.detach()}

    old = (
        _packed([s.old_log_probs for s in samples], samples, "old_log_probs", device)
        if samples[0].old_log_probs is not None
        else log_probs.detach()
    )
    rollout = (
        _packed([s.rollout_log_probs for s in samples], samples, "rollout_log_probs", device)
        if samples[0].rollout_log_probs is not None
        else None
    )
    if (config.use_tis or config.mis is not None or config.custom_tis is not None) and rollout is None:
        raise ValueError("rollout_log_probs missing for some samples (TIS/MIS need the engine's log-probs)")
    if (config.custom_tis is None) != (tis_function is None):
        raise ValueError("a custom TIS function goes with LossConfig.custom_tis: pass both or neither")
    advantages = expand_to_tokens(
        torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=device), lengths
    )
    pg = policy_loss(log_probs, old, advantages, config.eps_clip, config.eps_clip_high, config.eps_clip_c)
    per_token, pg_mask = pg.loss, mask

    def mean(x: torch.Tensor) -> torch.Tensor:
        return reduce_loss(x, mask, lengths, config.reduction, **reduce)

    if config.use_tis:
        weights = vanilla_tis_weights(old, rollout, config.tis_cap)
        per_token = per_token * weights
        metrics["tis_weight_mean"] = mean(weights)
        # tokens whose weight the cap truncated (slime's tis_clipfrac)
        metrics["tis_clipfrac"] = mean(((old - rollout) > math.log(config.tis_cap)).float())
    elif config.mis is not None:
        result = compute_is_weights(old, rollout, mask, lengths, config.mis, normalize_with=is_normalizer)
        # Their statistics are the whole batch's, not sums of micro-batches': health.signals.importance_signals.
        per_token, pg_mask = per_token * result.weights, result.mask
    elif tis_function is not None:
        result = call_tis_function(
            tis_function,
            config.custom_tis.args,
            pg_loss=per_token,
            old_log_probs=old,
            rollout_log_probs=rollout,
            mask=mask,
            response_lengths=lengths,
            total_lengths=[len(s.tokens) for s in samples],
        )
        # slime's: the function's metrics, and the ratio to the old policy ("ois"), are over the tokens before its
        # rejection; the policy loss and every term after it count only the tokens it kept, with the denominators
        # from before (a rejected token leaves the sums, not the counts).
        function_metrics = {name: mean(value) for name, value in result.metrics.items()}
        function_metrics["ois"] = mean(pg.ratio)
        kept = result.mask

        def mean(x: torch.Tensor) -> torch.Tensor:
            return reduce_loss(x * kept, mask, lengths, config.reduction, **reduce)

        per_token = result.pg_loss * kept
    loss = reduce_loss(per_token, pg_mask, lengths, config.reduction, **reduce)
    metrics["pg_loss"] = loss.detach()
    metrics["pg_clipfrac"] = mean(pg.clipped)
    metrics["pg_clipfrac_high"] = mean(pg.clipped * (pg.ratio > 1.0))  # the ratio rose past 1 + eps_clip_high
    metrics["pg_clipfrac_low"] = mean(pg.clipped * (pg.ratio < 1.0))  # it fell below 1 - eps_clip
    metrics["pg_clipfrac_dual"] = mean(pg.dual_clipped)
    if rollout is not None:  # the mean absolute log-ratio between trainer and engine (TIS's |log w| before the cap)
        metrics["train_rollout_logprob_abs_diff"] = mean((old - rollout).abs())
    if config.llds_coef:
        preserve = mean(likelihood_preservation(log_probs, old, mask, lengths))
        loss = loss + config.llds_coef * preserve
        metrics["llds_penalty"] = preserve.detach()
    if config.kl_coef:
        ref = _packed([s.ref_log_probs for s in samples], samples, "ref_log_probs", device)
        kl = mean(kl_estimate(log_probs, ref, config.kl_loss_type))
        loss = loss + config.kl_coef * kl
        metrics["kl_loss"] = kl.detach()
    # The entropy is a health signal in every step (its collapse or explosion comes before the reward's); it carries
    # gradient only when it is part of the loss.
    with torch.set_grad_enabled(bool(config.entropy_coef) and torch.is_grad_enabled()):
        ent = mean(entropy(rows, config.temperature, config.vocab_size))
    if config.entropy_coef:
        loss = loss - config.entropy_coef * ent
    metrics["entropy"] = ent.detach()
    metrics["nonfinite_log_probs"] = (~torch.isfinite(log_probs.detach())).sum().float()
    if tis_function is not None:
        taken = sorted(set(function_metrics) & (set(metrics) | {"loss"}))
        if taken:
            raise ValueError(f"{config.custom_tis.path} returned metrics {taken}: names the loss reports itself")
        metrics.update(function_metrics)
    return loss, metrics
