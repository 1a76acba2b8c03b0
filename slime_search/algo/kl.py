"""KL estimators (Schulman, "Approximating KL divergence") and entropy from logits."""

from __future__ import annotations

import torch

from slime_search.algo.importance import LOG_RATIO_BOUND

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi.

    With log_ratio = logp - logp_ref:
      k1 = log_ratio                         unbiased, high variance, can be negative
      k2 = log_ratio**2 / 2                  biased, low variance
      k3 = exp(-log_ratio) - 1 + log_ratio   unbiased, >= 0 ("low_var_kl"), clamped to [-10, 10]

    The clamp keeps one token with a collapsed reference probability from dominating the loss. Before exp the log-ratio
    is clamped to +-20, as verl does. k3 is at its clamp of 10 long before that, so no value changes. But
    exp(-log_ratio) no longer overflows float32 when the reference is ~89 nats above the policy. That overflow made the
    gradient 0 * inf = NaN at that token, masked or not, and so the whole step's.
    """
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(f"shapes differ: {tuple(log_probs.shape)} vs {tuple(ref_log_probs.shape)}")
    log_ratio = log_probs.float() - ref_log_probs.float()
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return log_ratio.square() / 2.0
    if kind in ("k3", "low_var_kl"):
        bounded = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        return torch.clamp(torch.exp(-bounded) - 1.0 + bounded, min=-10.0, max=10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; valid: {', '.join(KL_ESTIMATORS)}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum(softmax(z) * z), over the last dimension."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
