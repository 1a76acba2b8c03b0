"""Token log-probabilities and entropy from vocabulary-parallel logits, at the rollout temperature.

Each tensor-parallel rank holds logits for a slice of the vocabulary. The log-softmax normaliser needs the
maximum and the sum of exponentials over the whole vocabulary, so both are all-reduced across the TP group;
the target's logit lives on exactly one rank and is all-reduced as a sum. Logits are divided by the rollout
temperature first, so these are log-probs of the very distribution the engine sampled from.

Megatron pads the vocabulary to a multiple of 128 x TP (Qwen2.5's 151,936 becomes 152,064 at TP=2). Those
padded columns have logit 0, not -inf. Left in, they add mass to the normaliser and shift every log-prob (by
~8e-4 nats for the tiny test model at TP=2). Then the trainer's log-probs no longer match the engine's. Passing
`vocab_size` masks them out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelLogProb(torch.autograd.Function):
    """log softmax(z)[target] with z split over ranks along the vocabulary; gradient softmax - onehot, local."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        logits_max = logits.max(dim=-1, keepdim=True).values
        if group is not None:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max
        local = target - vocab_start
        in_range = (local >= 0) & (local < logits.shape[-1])
        picked = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * in_range
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if group is not None:
            dist.all_reduce(picked, group=group)
            dist.all_reduce(sum_exp, group=group)
        log_prob = picked - sum_exp.log()
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local, in_range)
        return log_prob

    @staticmethod
    def backward(ctx, grad):
        softmax, local, in_range = ctx.saved_tensors
        grad_logits = -softmax * grad.unsqueeze(-1)
        onehot = torch.zeros_like(softmax).scatter(-1, local.clamp(0, softmax.shape[-1] - 1).unsqueeze(-1), 1.0)
        grad_logits = grad_logits + onehot * in_range.unsqueeze(-1) * grad.unsqueeze(-1)
        return grad_logits, None, None, None


def _tp_group_and_start(vocab_slice: int):
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None, 0
    rank = parallel_state.get_tensor_model_parallel_rank()
    return parallel_state.get_tensor_model_parallel_group(), rank * vocab_slice


def _scaled(logits: torch.Tensor, temperature: float, vocab_size: int | None):
    scaled = logits.float() / temperature
    group, start = _tp_group_and_start(scaled.shape[-1])
    if vocab_size is not None and start + scaled.shape[-1] > vocab_size:
        padded = torch.arange(start, start + scaled.shape[-1], device=scaled.device) >= vocab_size
        scaled = scaled.masked_fill(padded, float("-inf"))
    return scaled, group, start


def token_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, vocab_size: int | None = None
) -> torch.Tensor:
    """log p(target) per position under softmax(logits / temperature) over the real (parallel) vocabulary."""
    scaled, group, start = _scaled(logits, temperature, vocab_size)
    return _VocabParallelLogProb.apply(scaled, targets, group, start)


def entropy(logits: torch.Tensor, temperature: float = 1.0, vocab_size: int | None = None) -> torch.Tensor:
    """H(softmax(logits / T)) per position over the real vocabulary: log Z - sum p z (differentiable)."""
    scaled, group, _ = _scaled(logits, temperature, vocab_size)
    logits_max = scaled.max(dim=-1, keepdim=True).values.detach()
    if group is not None:
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    shifted = scaled - logits_max
    exp = shifted.exp()
    sum_exp = exp.sum(dim=-1)
    weighted = (exp * shifted.masked_fill(exp == 0, 0.0)).sum(dim=-1)  # 0 * -inf would be nan
    if group is not None:
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp)
        weighted = reduce_from_tensor_model_parallel_region(weighted)
    return sum_exp.log() - weighted / sum_exp
