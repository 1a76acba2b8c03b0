"""What the GPU kit's parts share: the 3B recipe's own flags turned into the actor it trains, on one device; exact
fingerprints of device state; memory figures.

The recipe is read, not restated: `DRY_RUN=1 bash examples/search-r1/run_qwen2.5_3B.sh` prints the training command,
our parser reads it, and `slime_search.run.config` builds the actor's configuration from it as the run does. One
device changes what it must (TP 1, so no sequence parallelism; fp32 on CPU, where bf16 does not train) and says so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from typing import Any

from benchmarks.harness.recipe import recipe_flags

CHUNK = 1 << 26  # words a fingerprint reads at once: 512 MiB of int64 temporaries


def emit(record: dict) -> None:
    """One record of a part: a JSON line on stdout, which the kit collects."""
    print(json.dumps(record), flush=True)


@dataclasses.dataclass(frozen=True)
class RecipeOnOneDevice:
    """The recipe's model and actor configuration at TP 1 on one device."""

    model_name: str
    shape: Any  # ModelShape
    options: Any  # ModelOptions
    actor: Any  # ActorConfig, as run_config builds it from the recipe's flags
    with_reference: bool  # --use-kl-loss: the frozen KL reference is loaded beside the actor
    bucket_bytes: int  # --update-weight-buffer-size
    changed: tuple[str, ...]  # what one device changes of the recipe

    def summary(self) -> dict:
        from slime_search.backends.megatron.model import resolve_attention_impl

        options, optim, loss = self.options, self.actor.optim, self.actor.loss
        return {
            "model": self.model_name,
            "attention_impl": resolve_attention_impl(options.attention_impl),
            "recompute": "/".join(
                str(v) for v in (options.recompute_granularity, options.recompute_method, options.recompute_num_layers)
            ),
            "params_dtype": str(options.params_dtype).removeprefix("torch."),
            "distributed_optimizer": optim.use_distributed_optimizer,
            "max_tokens_per_gpu": self.actor.max_tokens_per_micro_batch,
            "kl": f"{loss.kl_loss_type} {loss.kl_coef:g}" if self.with_reference else None,
            "probe_tokens": self.actor.probe_tokens,
            "changed_for_one_device": list(self.changed),
        }


def recipe_on_one_device(model_name: str, cpu: bool, env: dict[str, str] | None = None) -> RecipeOnOneDevice:
    """The recipe's flags (for `model_name`) parsed by the trainer's parser, the actor's configuration built by
    run_config, the model's options as the run sets them (`model_source`), then what one device must change."""
    import torch

    from slime_search.arguments import build_parser
    from slime_search.backends.megatron.model_args import model_from_args
    from slime_search.run.config import actor_config, model_source

    args = build_parser().parse_args(recipe_flags(model_name, env))
    shape, options = model_from_args(args)
    overrides = dict(model_source(args).model_overrides)
    changed = []
    if args.tensor_model_parallel_size != 1:
        changed.append(f"--tensor-model-parallel-size {args.tensor_model_parallel_size} -> 1 (one device)")
    if overrides["sequence_parallel"]:
        overrides["sequence_parallel"] = False
        changed.append("--sequence-parallel off (Megatron refuses it at TP 1)")
    if cpu and overrides["params_dtype"] != torch.float32:
        overrides["params_dtype"] = torch.float32
        changed.append("--bf16 off (bf16 trains on GPU only)")
    return RecipeOnOneDevice(
        model_name=model_name,
        shape=shape,
        options=dataclasses.replace(options, **overrides),
        actor=actor_config(args, shape.vocab_size),
        with_reference=args.use_kl_loss,
        bucket_bytes=args.update_weight_buffer_size,
        changed=tuple(changed),
    )


def build_actor(recipe: RecipeOnOneDevice, with_reference: bool):
    """The recipe's actor on this rank's device (random weights), and its KL reference holding the same weights when
    asked for (as --ref-load of the initial checkpoint gives it); model-parallel state must be initialised."""
    from slime_search.backends.megatron.actor import MegatronActor, ReferenceModel
    from slime_search.backends.megatron.model import build_gpt_model

    model = build_gpt_model(recipe.shape, recipe.options)
    reference = None
    if with_reference:
        frozen = build_gpt_model(recipe.shape, recipe.options)
        frozen.load_state_dict(model.state_dict())
        reference = ReferenceModel(frozen, recipe.actor)
    return MegatronActor(model, recipe.actor), reference


def samples_of(count: int, shortest: int, longest: int, vocab: int):
    """`count` samples of random tokens, `shortest` to `longest` long, half of each the response, seeded."""
    from slime_search.types import TrainSample

    rng = random.Random(0)
    samples = []
    for _ in range(count):
        n = rng.randint(shortest, longest)
        response = n // 2
        tokens = [rng.randrange(vocab) for _ in range(n)]
        samples.append(TrainSample(tokens, response, [1] * response, rng.gauss(0, 1)))
    return samples


def prepare(actor, reference, samples) -> None:
    """What the driver's `prepare` sets before the steps: the old policy's log-probs, and the reference's."""
    for sample, old in zip(samples, actor.compute_log_probs(samples), strict=True):
        sample.old_log_probs = old
    if reference is not None:
        for sample, ref in zip(samples, reference.compute_log_probs(samples), strict=True):
            sample.ref_log_probs = ref


# ---- exact fingerprints ----------------------------------------------------------------------------------------
def fingerprint(tensor) -> tuple[int, int]:
    """(sum, position-weighted sum) of the tensor's bytes read as integer words, on its own device: equal for equal
    bytes, and different for a zeroed, stale, shifted or partly copied tensor. Two copies of a 50 GiB state cannot be
    held to compare them exactly; two integers per tensor can."""
    import torch

    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    for word in (torch.int32, torch.int16, torch.uint8):
        if data.numel() % word.itemsize == 0:
            data = data.view(word)
            break
    total = weighted = 0
    for start in range(0, data.numel(), CHUNK):
        words = data[start : start + CHUNK].to(torch.int64)
        weights = torch.arange(start, start + words.numel(), device=words.device, dtype=torch.int64) % 1_000_003 + 1
        total += int(words.sum())
        weighted += int((words * weights).sum())  # int64 wraps alike for equal inputs
    return total, weighted


def tensors_in(state) -> list:
    """Every tensor of a nested state (dicts in their order, lists, tuples), depth first."""
    import torch

    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for value in state.values() for t in tensors_in(value)]
    if isinstance(state, (list, tuple)):
        return [t for value in state for t in tensors_in(value)]
    return []


def state_fingerprints(actor, reference=None) -> dict[str, list[tuple[int, int]]]:
    """Fingerprints of the actor's parameters, of everything its optimizer saves (master weights, moments), and of
    the reference's parameters."""
    found = {
        "params": [fingerprint(p) for p in actor.model.parameters()],
        "optimizer": [fingerprint(t) for t in tensors_in(actor.optimizer.state_dict())],
    }
    if reference is not None:
        found["reference"] = [fingerprint(p) for p in reference.model.parameters()]
    return found


# ---- memory ------------------------------------------------------------------------------------------------------
def gib(n: float) -> float:
    return round(n / 2**30, 2)


def resident_gib() -> float:
    """This process's resident host memory (pinned host buffers count once touched)."""
    with open("/proc/self/statm") as handle:
        return gib(int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))


def device_memory() -> dict[str, float]:
    """The device as a whole (every process on it: torch.cuda.mem_get_info) and this process's allocator; on CPU the
    process's resident memory."""
    import torch

    if not torch.cuda.is_available():
        return {"host_resident_gib": resident_gib()}
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {
        "device_used_gib": gib(total - free),
        "device_free_gib": gib(free),
        "allocated_gib": gib(torch.cuda.memory_allocated()),
        "reserved_gib": gib(torch.cuda.memory_reserved()),
        "host_resident_gib": resident_gib(),
    }


def peak_memory() -> dict[str, float]:
    """The allocator's peaks since the last reset (CUDA), or the process's peak resident set (CPU)."""
    import resource

    import torch

    if not torch.cuda.is_available():
        return {"peak_host_resident_gib": gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}
    return {
        "peak_allocated_gib": gib(torch.cuda.max_memory_allocated()),
        "peak_reserved_gib": gib(torch.cuda.max_memory_reserved()),
        "device_total_gib": gib(torch.cuda.mem_get_info()[1]),
    }


def out_of_memory(error: BaseException) -> str:
    return f"out of memory: {str(error).splitlines()[0][:300]}"
