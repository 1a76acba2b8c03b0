"""The Megatron actor of one rank: log-probs and GRPO/SFT training steps over packed, token-budgeted micro-batches.

Each rank holds a tensor-parallel shard of the model and its data-parallel share of the batch. A step walks
micro-batches of at most `max_tokens_per_micro_batch` tokens. It backpropagates each micro-batch's loss normalised
by the global token / sequence counts, so accumulation reproduces the full-batch loss. Then it reduces gradients
with Megatron DDP and steps the optimizer once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import torch

from slime_search.algo import LOG_RATIO_BOUND
from slime_search.backends.megatron.logprobs import token_log_probs
from slime_search.backends.megatron.loss import (
    LossConfig,
    local_batch_counts,
    local_mis_stats,
    micro_batch_loss,
    response_logits_and_targets,
)
from slime_search.backends.megatron.offload import (
    StorageOffloader,
    gradient_tensors,
    model_tensors,
    optimizer_tensors,
)
from slime_search.backends.megatron.optimizer import OptimConfig, build_optimizer
from slime_search.backends.megatron.packing import PackedBatch, pack, split_by_token_budget
from slime_search.types import TrainSample


@dataclass(frozen=True)
class ActorConfig:
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    max_tokens_per_micro_batch: int = 4096
    # After an applied step, the log-probs of about this many of the rank's tokens are computed again under the new
    # weights: how far the step moved the policy on what it trained on (0: not measured).
    probe_tokens: int = 512


# Metrics of a step that every data-parallel rank reports whole (the same value on each rank); all the others are
# the rank's share of a global-batch quantity, summed over the data-parallel ranks.
REPLICATED_METRICS = frozenset({"grad_norm", "step_applied", "lr", "kl_old_new", "logp_shift_pos", "logp_shift_neg"})


@dataclass(frozen=True)
class Layout:
    """How a model takes a packed micro-batch, fixed when the model is built."""

    device: torch.device
    thd: bool  # packed sequences as THD (cumulative lengths), else the row's block-diagonal mask
    multiple: int  # the packed row's length must divide by this (sequence parallelism splits it over TP ranks)

    @classmethod
    def of(cls, model) -> Layout:
        """`model`: the GPTModel (not its DDP wrapper). TransformerEngine's attention and PackedAttention take THD;
        Megatron's own local attention (--attention-impl local) refuses packed sequence parameters and takes only the
        block-diagonal causal mask."""
        from slime_search.backends.megatron.model import takes_packed_sequences

        config = model.config
        multiple = config.tensor_model_parallel_size if config.sequence_parallel else 1
        return cls(next(model.parameters()).device, takes_packed_sequences(model), multiple)


def _forward(model, packed: PackedBatch, layout: Layout) -> torch.Tensor:
    """Logits of a packed row, computed on the model's device."""
    from megatron.core.packed_seq_params import PackedSeqParams

    input_ids, position_ids = packed.input_ids.to(layout.device), packed.position_ids.to(layout.device)
    if not layout.thd:
        return model(input_ids, position_ids, attention_mask=packed.attention_mask().to(layout.device))
    cu = packed.cu_seqlens.to(layout.device)
    longest = max(packed.segment_lengths)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )
    return model(input_ids, position_ids, attention_mask=None, packed_seq_params=params)


@torch.no_grad()
def packed_log_probs(model, layout: Layout, samples: list[TrainSample], config: ActorConfig) -> list[list[float]]:
    """Response log-probs of every sample, micro-batch by micro-batch."""
    out: list[list[float]] = [[] for _ in samples]
    for indices in split_by_token_budget([len(s.tokens) for s in samples], config.max_tokens_per_micro_batch):
        batch = [samples[i] for i in indices]
        packed = pack([s.tokens for s in batch], [s.response_length for s in batch], layout.multiple)
        rows, targets = response_logits_and_targets(_forward(model, packed, layout), packed)
        values = token_log_probs(rows, targets, config.loss.temperature, config.loss.vocab_size).cpu()
        for i, part in zip(indices, torch.split(values, packed.response_lengths), strict=True):
            out[i] = part.tolist()
    return out


def probe_samples(samples: list[TrainSample], budget: int) -> list[TrainSample]:
    """Samples whose tokens fit `budget`, those with a positive and a negative advantage taken in turn (they are what
    the update pushed up and down; zero-advantage ones only fill what is left); at least one when the budget is
    positive."""
    known = [s for s in samples if s.old_log_probs is not None]
    positive = [s for s in known if s.advantage > 0]
    negative = [s for s in known if s.advantage < 0]
    alternating = [s for pair in itertools.zip_longest(positive, negative) for s in pair if s is not None]
    chosen, used = [], 0
    for sample in alternating + [s for s in known if s.advantage == 0]:
        if budget <= 0 or (chosen and used + len(sample.tokens) > budget):
            break
        chosen.append(sample)
        used += len(sample.tokens)
    return chosen


def policy_shift_sums(samples: list[TrainSample], new_log_probs: list[list[float]]) -> torch.Tensor:
    """(sum k3, tokens, sum of log-prob change where A > 0, tokens, where A < 0, tokens) over the loss tokens, to be
    summed over ranks; k3 = r - 1 - log r with log r = new - old estimates KL(old || new) from the old policy's
    samples."""
    sums = torch.zeros(6, dtype=torch.float64)
    for sample, new in zip(samples, new_log_probs, strict=True):
        mask = torch.tensor(sample.loss_mask, dtype=torch.float64)
        log_ratio = torch.tensor(new, dtype=torch.float64) - torch.tensor(sample.old_log_probs, dtype=torch.float64)
        log_ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        k3 = log_ratio.exp() - 1.0 - log_ratio
        tokens = mask.sum()
        sums[0] += (k3 * mask).sum()
        sums[1] += tokens
        side = 2 if sample.advantage > 0 else 4 if sample.advantage < 0 else None
        if side is not None:
            sums[side] += (log_ratio * mask).sum()
            sums[side + 1] += tokens
    return sums


def policy_shift_metrics(sums: torch.Tensor) -> dict[str, float]:
    """Means of `policy_shift_sums` (summed over ranks); a side with no token is left out."""
    out = {}
    names = ("kl_old_new", "logp_shift_pos", "logp_shift_neg")
    for name, (total, count) in zip(names, sums.view(3, 2).tolist(), strict=True):
        if count > 0:
            out[name] = total / count
    return out


class ReferenceModel:
    """A frozen copy of the initial policy for the KL term (`--ref-load`): forward only, no gradients."""

    def __init__(self, model, config: ActorConfig):
        self.model = model.eval()
        for param in self.model.parameters():
            param.requires_grad_(False)
        self.config = config
        self.layout = Layout.of(model)
        self.offloader = StorageOffloader()

    def compute_log_probs(self, samples: list[TrainSample]) -> list[list[float]]:
        return packed_log_probs(self.model, self.layout, samples, self.config)

    def offload(self) -> int:
        return self.offloader.offload(model_tensors(self.model))

    def onload(self) -> int:
        return self.offloader.onload()


class AdapterOffReference:
    """The KL reference under LoRA: the actor's own model with its adapters disabled, which is the frozen base (no
    second model is loaded, and none is offloaded)."""

    def __init__(self, actor: MegatronActor):
        self.actor = actor

    def compute_log_probs(self, samples: list[TrainSample]) -> list[list[float]]:
        from slime_search.backends.megatron.lora import adapters_disabled

        self.actor.model.eval()
        with adapters_disabled(self.actor.model.module):
            return packed_log_probs(self.actor.model, self.actor.layout, samples, self.actor.config)

    def offload(self) -> int:
        return 0

    def onload(self) -> int:
        return 0


class MegatronActor:
    def __init__(self, model, config: ActorConfig):
        """`model`: a GPTModel on this rank, weights loaded; model-parallel state initialised. The optimizer takes
        the model's own parameter dtype (bf16 gets Megatron's mixed-precision optimizer with fp32 main weights)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        self.config = config
        self.layout = Layout.of(model)
        self.model = DistributedDataParallel(
            config=model.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=config.optim.use_distributed_optimizer,
            ),
            module=model,
        )
        self.optimizer = build_optimizer(self.model, config.optim, model.config.params_dtype)
        self.offloader = StorageOffloader()
        # --custom-tis-function-path, loaded once in this rank's process (the config carries its path)
        self.tis_function = config.loss.custom_tis.load() if config.loss.custom_tis is not None else None

    def offload(self) -> int:
        """Give back the memory of weights, gradients and optimizer state (--colocate); returns bytes. The gradients
        are not copied: train_step zeroes them before it accumulates any."""
        tensors = model_tensors(self.model) + optimizer_tensors(self.optimizer)
        return self.offloader.offload(tensors, discard=gradient_tensors(self.model))

    def onload(self) -> int:
        return self.offloader.onload()

    def _micro_batches(self, samples: list[TrainSample]) -> list[list[int]]:
        return split_by_token_budget([len(s.tokens) for s in samples], self.config.max_tokens_per_micro_batch)

    def compute_log_probs(self, samples: list[TrainSample]) -> list[list[float]]:
        """Per-sample response log-probs at the rollout temperature (the old policy's, before a step)."""
        self.model.eval()
        return packed_log_probs(self.model, self.layout, samples, self.config)

    def sequence_log_probs(self, token_ids: list[int]) -> list[float]:
        """The policy's log-probs of token_ids[1:], each given the tokens before it, at temperature 1: what an engine
        answers for its input tokens (the probe of the engines against the trainer), one packed sample."""
        self.model.eval()
        sample = TrainSample(list(token_ids), len(token_ids) - 1, [1] * (len(token_ids) - 1))
        model_own = replace(self.config, loss=replace(self.config.loss, temperature=1.0))
        return packed_log_probs(self.model, self.layout, [sample], model_own)[0]

    # ---- training -----------------------------------------------------------------------------------------
    def train_step(self, samples: list[TrainSample], skip_above: float | None = None) -> dict[str, float]:
        """One optimizer step on this rank's samples (the data-parallel share of the global batch). The update is not
        applied when the gradient norm is not finite or above `skip_above` (a spike the driver's guard bounds)."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        counts = local_batch_counts(samples, self.layout.device)
        dp_size = parallel_state.get_data_parallel_world_size()
        if dp_size > 1:
            dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
        num_tokens, num_sequences = float(counts[0]), int(counts[1])
        is_normalizer = self._mis_normalizer(samples)
        totals: dict[str, float] = {}
        for indices in self._micro_batches(samples):
            batch = [samples[i] for i in indices]
            packed = pack([s.tokens for s in batch], [s.response_length for s in batch], self.layout.multiple)
            logits = _forward(self.model, packed, self.layout)
            loss, metrics = micro_batch_loss(
                logits, packed, batch, self.config.loss, num_tokens, num_sequences, is_normalizer, self.tis_function
            )
            # DDP averages gradients over data-parallel ranks; the loss is already a global-batch sum.
            (loss * dp_size).backward()
            totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())
            for name, value in metrics.items():
                totals[name] = totals.get(name, 0.0) + float(value)
        self._finalize_grads()
        applied, grad_norm = self.optimizer.step(skip_above)
        totals.update(grad_norm=grad_norm, step_applied=float(applied), lr=self.optimizer.current_lr())
        if applied and self.config.loss.loss_type == "policy_loss":
            totals.update(self._probe_policy_shift(samples))
        return totals

    def _probe_policy_shift(self, samples: list[TrainSample]) -> dict[str, float]:
        """How far the step moved the policy on tokens it trained on.

        The measures are k3 KL(old || new) and the mean log-prob change of tokens with positive and with negative
        advantage. The update should raise the first. When it lowers them (likelihood displacement), the policy is
        drifting off what it was rewarded for. They are taken over the first samples of this rank up to
        `probe_tokens` tokens, reduced over the data-parallel ranks."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        probe = probe_samples(samples, self.config.probe_tokens)
        stats = torch.zeros(6, dtype=torch.float64, device=self.layout.device)
        if probe:
            self.model.eval()
            new = packed_log_probs(self.model, self.layout, probe, self.config)
            stats = policy_shift_sums(probe, new).to(self.layout.device)
        if parallel_state.get_data_parallel_world_size() > 1:
            dist.all_reduce(stats, group=parallel_state.get_data_parallel_group())
        return policy_shift_metrics(stats.cpu())

    def _finalize_grads(self) -> None:
        """Not only the data-parallel reduction (DDP's finish_grad_sync): with sequence parallelism each tensor-parallel
        rank holds a partial gradient of the replicated layer norms, which finalize_model_grads sums across ranks."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.model])

    def _mis_normalizer(self, samples: list[TrainSample]) -> torch.Tensor | None:
        """(sum, count) of the MIS weights over the global batch: every micro-batch and data-parallel rank."""
        mis = self.config.loss.mis
        if mis is None or not mis.batch_normalize:
            return None
        import torch.distributed as dist
        from megatron.core import parallel_state

        stats = local_mis_stats(samples, mis, self.layout.device)
        if parallel_state.get_data_parallel_world_size() > 1:
            dist.all_reduce(stats, group=parallel_state.get_data_parallel_group())
        return stats.float()

    def local_state_dict(self, fold_adapters: bool = True) -> dict[str, torch.Tensor]:
        """This rank's shard of the weights, Megatron names (for gathering into HF weights); under LoRA each adapter
        folded into its base weight, or with `fold_adapters=False` the frozen base alone."""
        from slime_search.backends.megatron.lora import lora_modules, merged_state_dict

        model = self.model.module
        if next(lora_modules(model), None) is not None:
            return merged_state_dict(model, fold=fold_adapters)
        return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
