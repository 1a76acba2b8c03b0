"""PPO clipped policy-gradient loss with asymmetric clipping (clip-higher) and optional dual clip."""

from __future__ import annotations

from typing import NamedTuple

import torch

from slime_search.algo.importance import LOG_RATIO_BOUND


class PolicyLossOutput(NamedTuple):
    loss: torch.Tensor  # per token, to be reduced with a mask
    clipped: torch.Tensor  # per token: 1.0 where the clipped surrogate was the active (larger) loss
    dual_clipped: torch.Tensor  # per token: 1.0 where the dual-clip bound was active (A < 0 only)
    ratio: torch.Tensor  # per token, detached: exp(logp - logp_old), of the clamped log-ratio


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> PolicyLossOutput:
    """Per-token PPO loss.

    ratio = exp(logp - logp_old)
    loss  = max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_high))

    Dual clip (eps_clip_c > 1, only where A < 0): loss = min(loss, -A * eps_clip_c). It bounds how much a token with
    a huge ratio and a negative advantage can push.

    The log-ratio is clamped to +-LOG_RATIO_BOUND (verl's 20) before exp. Beyond ~88.7, exp overflows float32. One
    such token, even a masked one, would turn the step's loss and gradient into inf * 0 = NaN. With the clamp, such a
    token gets no gradient. It has already moved e^20-fold in one step.
    """
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    if eps_clip < 0 or eps_clip_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got eps_clip={eps_clip}, eps_clip_high={eps_clip_high}")
    if not (log_probs.shape == old_log_probs.shape == advantages.shape):
        raise ValueError(
            f"shapes differ: log_probs {tuple(log_probs.shape)}, old {tuple(old_log_probs.shape)}, "
            f"advantages {tuple(advantages.shape)}"
        )
    ratio = torch.exp((log_probs - old_log_probs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = (clipped > unclipped).to(loss.dtype)
    dual_active = torch.zeros_like(loss)
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"dual-clip bound eps_clip_c must be > 1.0, got {eps_clip_c}")
        bound = -advantages * eps_clip_c
        negative = advantages < 0
        dual_active = (negative & (loss > bound)).to(loss.dtype)
        loss = torch.where(negative, torch.minimum(loss, bound), loss)
    return PolicyLossOutput(loss, clip_active.detach(), dual_active.detach(), ratio.detach())


def likelihood_preservation(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor, lengths: list[int] | torch.Tensor
) -> torch.Tensor:
    """Per-token penalty of a likelihood-preserving regulariser in the manner of LLDS (arXiv 2512.04220). It acts only
    on a response whose likelihood fell below the old policy's (the masked sum of logp - logp_old < 0). Within it, it
    acts only on the tokens whose log-prob fell, by how much it fell:

        penalty_t = max(0, logp_old_t - logp_t) * 1[sum_t m_t (logp_t - logp_old_t) < 0]

    Added to the loss with a coefficient, its gradient raises exactly the tokens that lost likelihood, and nothing
    while a response's likelihood holds. At the first optimizer step of a rollout the policy is the old one and the
    penalty is 0; it acts from the second step on (a --global-batch-size below the rollout's size)."""
    from slime_search.algo.reductions import per_sequence_sums, segment_ids

    drop = old_log_probs - log_probs
    fell = per_sequence_sums(drop.detach(), mask, lengths) > 0
    return torch.clamp(drop, min=0.0) * fell[segment_ids(lengths, device=drop.device)].to(drop.dtype)
