"""Pure tensor functions for the RL maths: no `args`, no I/O, no distributed calls.

Token-level tensors are *packed*: the responses of a batch concatenated into one 1-D tensor, with the
per-sequence lengths given alongside. That is the layout the trainer uses, and it keeps every function here
vectorised over sequences of unequal length.
"""

from slime_search.algo.advantages import expand_to_tokens, grpo_advantages
from slime_search.algo.importance import (
    LOG_RATIO_BOUND,
    ISConfig,
    ISResult,
    compute_is_weights,
    is_batch_stats,
    vanilla_tis_weights,
)
from slime_search.algo.kl import KL_ESTIMATORS, entropy_from_logits, kl_estimate
from slime_search.algo.policy_loss import likelihood_preservation, policy_loss
from slime_search.algo.reductions import (
    REDUCTIONS,
    masked_mean,
    masked_sum,
    reduce_loss,
    segment_ids,
    sequence_mean,
    token_mean,
)

__all__ = [
    "KL_ESTIMATORS",
    "LOG_RATIO_BOUND",
    "REDUCTIONS",
    "ISConfig",
    "ISResult",
    "compute_is_weights",
    "entropy_from_logits",
    "expand_to_tokens",
    "grpo_advantages",
    "is_batch_stats",
    "kl_estimate",
    "likelihood_preservation",
    "masked_mean",
    "masked_sum",
    "policy_loss",
    "reduce_loss",
    "segment_ids",
    "sequence_mean",
    "token_mean",
    "vanilla_tis_weights",
]
