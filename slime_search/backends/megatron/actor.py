"""The Megatron actor of one rank: log-probs and GRPO/SFT training steps over packed, token-budgeted micro-batches.

Each rank holds a tensor-parallel shard of the model and its data-parallel share of the batch. A step walks
micro-batches of at most `max_tokens_per_micro_batch` tokens, backpropagates each micro-batch's loss normalised
by the global token / sequence counts (so accumulation reproduces the full-batch loss), reduces gradients with
Megatron DDP and steps the optimizer once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from slime_search.backends.megatron.logprobs import token_log_probs
from slime_search.backends.megatron.loss import LossConfig, micro_batch_loss, response_logits_and_targets
from slime_search.backends.megatron.offload import StorageOffloader, model_tensors, optimizer_tensors
from slime_search.backends.megatron.optimizer import OptimConfig, build_optimizer
from slime_search.backends.megatron.packing import PackedBatch, pack, split_by_token_budget
from slime_search.types import TrainSample


@dataclass(frozen=True)
class ActorConfig:
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    max_tokens_per_micro_batch: int = 4096


def _forward(model, packed: PackedBatch) -> torch.Tensor:
    """Logits of a packed row: block-diagonal causal mask on CPU, THD packed sequences on GPU."""
    from slime_search.backends.megatron import cpu_compat

    if cpu_compat.is_active():
        return model(packed.input_ids, packed.position_ids, attention_mask=packed.attention_mask())
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = packed.cu_seqlens.cuda()
    longest = max(packed.lengths)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )
    return model(packed.input_ids.cuda(), packed.position_ids.cuda(), attention_mask=None, packed_seq_params=params)


@torch.no_grad()
def packed_log_probs(forward, samples: list[TrainSample], config: ActorConfig) -> list[list[float]]:
    """Response log-probs of every sample, micro-batch by micro-batch."""
    out: list[list[float]] = [[] for _ in samples]
    for indices in split_by_token_budget([len(s.tokens) for s in samples], config.max_tokens_per_micro_batch):
        batch = [samples[i] for i in indices]
        packed = pack([s.tokens for s in batch], [s.response_length for s in batch])
        rows, targets = response_logits_and_targets(forward(packed), packed)
        values = token_log_probs(rows, targets, config.loss.temperature, config.loss.vocab_size).cpu()
        for i, part in zip(indices, torch.split(values, packed.response_lengths), strict=True):
            out[i] = part.tolist()
    return out


class ReferenceModel:
    """A frozen copy of the initial policy for the KL term (`--ref-load`): forward only, no gradients."""

    def __init__(self, model, config: ActorConfig):
        self.model = model.eval()
        for param in self.model.parameters():
            param.requires_grad_(False)
        self.config = config
        self.offloader = StorageOffloader()

    def compute_log_probs(self, samples: list[TrainSample]) -> list[list[float]]:
        return packed_log_probs(lambda p: _forward(self.model, p), samples, self.config)

    def offload(self) -> int:
        return self.offloader.offload(model_tensors(self.model))

    def onload(self) -> int:
        return self.offloader.onload()


class MegatronActor:
    def __init__(self, model, config: ActorConfig, params_dtype: torch.dtype = torch.float32):
        """`model`: a GPTModel on this rank, weights loaded; model-parallel state initialised."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        self.config = config
        self.model = DistributedDataParallel(
            config=model.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=config.optim.use_distributed_optimizer,
            ),
            module=model,
        )
        self.optimizer = build_optimizer(self.model, config.optim, params_dtype)
        self.offloader = StorageOffloader()

    def offload(self) -> int:
        """Give back the memory of weights, gradients and optimizer state (--colocate); returns bytes."""
        return self.offloader.offload(model_tensors(self.model) + optimizer_tensors(self.optimizer))

    def onload(self) -> int:
        return self.offloader.onload()

    def _logits(self, packed: PackedBatch) -> torch.Tensor:
        return _forward(self.model, packed)

    def _micro_batches(self, samples: list[TrainSample]) -> list[list[int]]:
        return split_by_token_budget([len(s.tokens) for s in samples], self.config.max_tokens_per_micro_batch)

    def compute_log_probs(self, samples: list[TrainSample]) -> list[list[float]]:
        """Per-sample response log-probs at the rollout temperature (the old policy's, before a step)."""
        self.model.eval()
        return packed_log_probs(lambda p: _forward(self.model, p), samples, self.config)

    # ---- training -----------------------------------------------------------------------------------------
    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """One optimizer step on this rank's samples (the data-parallel share of the global batch)."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        counts = torch.tensor([sum(sum(s.loss_mask) for s in samples), len(samples)], dtype=torch.float64)
        dp_size = parallel_state.get_data_parallel_world_size()
        if dp_size > 1:
            dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
        num_tokens, num_sequences = float(counts[0]), int(counts[1])
        is_normalizer = self._mis_normalizer(samples)
        totals: dict[str, float] = {}
        for indices in self._micro_batches(samples):
            batch = [samples[i] for i in indices]
            packed = pack([s.tokens for s in batch], [s.response_length for s in batch])
            loss, metrics = micro_batch_loss(
                self._logits(packed), packed, batch, self.config.loss, num_tokens, num_sequences, is_normalizer
            )
            # DDP averages gradients over data-parallel ranks; the loss is already a global-batch sum.
            (loss * dp_size).backward()
            totals["loss"] = totals.get("loss", 0.0) + float(loss)
            for name, value in metrics.items():
                totals[name] = totals.get(name, 0.0) + float(value)
        self.model.finish_grad_sync()
        applied, grad_norm = self.optimizer.step()
        totals.update(grad_norm=grad_norm, step_applied=float(applied))
        return totals

    def _mis_normalizer(self, samples: list[TrainSample]) -> torch.Tensor | None:
        """(sum, count) of the MIS weights over the global batch: every micro-batch and data-parallel rank."""
        mis = self.config.loss.mis
        if mis is None or not mis.batch_normalize:
            return None
        import dataclasses

        import torch.distributed as dist
        from megatron.core import parallel_state

        from slime_search.algo import compute_is_weights, is_batch_stats

        raw = dataclasses.replace(mis, batch_normalize=False)
        lengths = [s.response_length for s in samples]
        old = torch.tensor([x for s in samples for x in s.old_log_probs])
        rollout = torch.tensor([x for s in samples for x in s.rollout_log_probs])
        mask = torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.float32)
        result = compute_is_weights(old, rollout, mask, lengths, raw)
        stats = is_batch_stats(result.weights, result.mask, lengths, mis.level).double()
        if parallel_state.get_data_parallel_world_size() > 1:
            dist.all_reduce(stats, group=parallel_state.get_data_parallel_group())
        return stats.float()

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shard of the weights, Megatron names (for gathering into HF weights)."""
        return {k: v for k, v in self.model.module.state_dict().items() if not k.endswith("_extra_state")}
