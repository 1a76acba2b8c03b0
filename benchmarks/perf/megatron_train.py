"""GPU benchmark of a Megatron train step (Qwen2.5-3B's shape by default, random weights): tokens/s, memory, MFU.

    torchrun --nproc-per-node 2 -m benchmarks.perf.megatron_train --tp 2 --steps 5
    # single GPU:
    python -m benchmarks.perf.megatron_train --tp 1
    # smallest (a smoke run): a two-layer model of the same kind, two short samples, one step
    python -m benchmarks.perf.megatron_train --num-layers 2 --hidden-size 256 --num-heads 4 --num-kv-heads 2 \
        --intermediate-size 512 --samples 2 --seq-len 64 --steps 1

Each step is a GRPO policy-loss step over packed random sequences (bf16, distributed optimizer; --attention-impl:
TransformerEngine's layer spec when it is installed, else the local spec with the packed attention). MFU counts 6 x
parameters x tokens (forward + backward, attention FLOPs excluded) against the card's dense bf16 peak given by
--peak-tflops (H100 SXM: 989).

Its figures: `docs/benchmarks/megatron.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from benchmarks.harness.handover import handover


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    # the model's shape: Qwen2.5-3B's by default
    parser.add_argument("--num-layers", type=int, default=36)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=11008)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--max-tokens-per-gpu", type=int, default=16384)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--attention-impl", choices=["auto", "te", "local", "packed"], default="auto")
    parser.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    parser.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    parser.add_argument("--recompute-num-layers", type=int, default=None)
    parser.add_argument(
        "--phase-memory",
        action="store_true",
        help="also report the peak device memory of each phase of a step (forward, loss, backward, optimizer)",
    )
    parser.add_argument(
        "--offload", action="store_true", help="after the steps, time --colocate's hand-over of the actor's memory"
    )
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    from megatron_bridge import ModelShape
    from megatron_bridge.param_count import count_parameters
    from slime_search.backends.megatron.actor import ActorConfig, MegatronActor
    from slime_search.backends.megatron.distributed import init_megatron
    from slime_search.backends.megatron.loss import LossConfig
    from slime_search.backends.megatron.model import ModelOptions, build_gpt_model
    from slime_search.backends.megatron.optimizer import OptimConfig
    from slime_search.types import TrainSample
    from slime_search.utils.net import free_port

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    port, address = int(os.environ.get("MASTER_PORT", free_port())), os.environ.get("MASTER_ADDR", "127.0.0.1")
    init_megatron(rank, world, tp_size=args.tp, master_port=port, master_address=address)
    shape = ModelShape(
        args.num_layers, args.hidden_size, args.num_heads, args.num_kv_heads, args.intermediate_size, 151936, True
    )
    options = ModelOptions(
        params_dtype=torch.bfloat16,
        sequence_parallel=args.tp > 1,
        attention_impl=args.attention_impl,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
    )
    model = build_gpt_model(shape, options).cuda()
    config = ActorConfig(
        loss=LossConfig(vocab_size=shape.vocab_size),
        optim=OptimConfig(lr=1e-6, use_distributed_optimizer=True),
        max_tokens_per_micro_batch=args.max_tokens_per_gpu,
    )
    actor = MegatronActor(model, config)  # bf16 parameters: Megatron's mixed-precision optimizer
    rng = random.Random(rank)
    samples = []
    for _ in range(args.samples):
        n = rng.randint(args.seq_len // 2, args.seq_len)
        response = n // 2
        samples.append(
            TrainSample([rng.randrange(shape.vocab_size) for _ in range(n)], response, [1] * response, rng.gauss(0, 1))
        )
    tokens = sum(len(s.tokens) for s in samples)
    phases = track_phase_peaks(actor) if args.phase_memory else None
    actor.train_step(samples)  # warm-up
    if phases is not None:
        phases.peaks.clear()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        metrics = actor.train_step(samples)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.steps
    tokens_per_s = tokens / seconds
    params = count_parameters(shape)
    mfu = 6 * params * tokens_per_s / (args.peak_tflops * 1e12 * args.tp)
    handover = measure_handover(actor) if args.offload else {}
    if phases is not None:
        handover["phase_peak_gib"] = {k: round(v, 2) for k, v in phases.peaks.items()}
    if rank == 0:
        print(
            json.dumps(
                {
                    **handover,
                    "gpus": world,
                    "tp": args.tp,
                    "max_tokens_per_micro_batch": args.max_tokens_per_gpu,
                    "recompute": args.recompute_granularity,
                    "tokens_per_step_per_dp_rank": tokens,
                    "step_s": round(seconds, 3),
                    "tokens_per_s": round(tokens_per_s, 1),
                    "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                    "mfu": round(mfu, 4),
                    "last_step": {k: metrics.get(k) for k in ("loss", "grad_norm", "step_applied")},
                }
            )
        )
    return 0


class PhasePeaks:
    """Peak device memory between consecutive marks, by the pair of marks (the phase between them)."""

    def __init__(self):
        self.last, self.peaks = "step", {}

    def mark(self, label: str) -> None:
        import torch

        torch.cuda.synchronize()
        key = f"{self.last}..{label}"
        self.peaks[key] = max(self.peaks.get(key, 0.0), torch.cuda.max_memory_allocated() / 2**30)
        torch.cuda.reset_peak_memory_stats()
        self.last = label


def track_phase_peaks(actor) -> PhasePeaks:
    """Marks around the forward, the loss, gradient finalisation and the optimizer step; the backward passes fall
    between a loss's end and the next forward or the finalisation."""
    from slime_search.backends.megatron import actor as actor_module

    phases = PhasePeaks()

    def marked(function, name):
        def wrapper(*args, **kwargs):
            phases.mark(name)
            out = function(*args, **kwargs)
            phases.mark(f"{name}_end")
            return out

        return wrapper

    actor_module._forward = marked(actor_module._forward, "forward")
    actor_module.micro_batch_loss = marked(actor_module.micro_batch_loss, "loss")
    actor._finalize_grads = marked(actor._finalize_grads, "finalize")
    actor.optimizer.step = marked(actor.optimizer.step, "optimizer")
    return phases


def measure_handover(actor) -> dict:
    """Two hand-overs: the first allocates (and pins) the host buffers, later ones reuse them."""
    return {f"handover_{round_}": handover(actor) for round_ in (1, 2)}


if __name__ == "__main__":
    sys.exit(main())
