"""One attention implementation's GRPO train step at several token budgets per micro-batch: one JSON line per budget.

    python -m tools.gpu_check.step --attention-impl packed --budgets 2048,4096,8192      # CUDA: Qwen2.5-3B shape
    python -m tools.gpu_check.step --attention-impl local --cpu                           # CPU: the tiny shape
    python -m tools.gpu_check.step --attention-impl packed --recompute --budgets 8192       # as the 3B recipe runs

The attentions compared on one device (`tools.gpu_check.kit` runs the recipe's own step instead:
`tools.gpu_check.recipe`); run once per implementation and budget for a fresh process and device each. Random
weights seeded alike (both implementations start from the same weights: the first step's loss and gradient norm must
agree), bf16 and the distributed optimizer on CUDA, fp32 on CPU; the same packed samples at every budget. Per budget:
one warm-up step, then --steps timed steps. MFU counts 6 x parameters x tokens (attention FLOPs excluded, as in
benchmarks.perf.megatron_train) against --peak-tflops. On CUDA a budget that runs out of memory is recorded as such and
ends the run (larger budgets need more). On CPU the memory figure is the process's peak resident set so far (the
budgets run in increasing order). CPU defaults: 4 samples of 32-64 tokens, budgets 64, 128, 256.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

GPU_SHAPE = (36, 2048, 16, 2, 11008, 151936, True)  # Qwen2.5-3B
CPU_SHAPE = (2, 64, 4, 2, 128, 151936, True)  # the tiny Qwen2 of the CPU tests


def peak_memory_gib(cuda: bool) -> float:
    if cuda:
        import torch

        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kilobytes on Linux


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention-impl", choices=["packed", "local", "te"], required=True)
    parser.add_argument("--cpu", action="store_true", help="the tiny shape on CPU, fp32")
    parser.add_argument("--budgets", default=None, help="tokens per micro-batch, comma-separated (increasing)")
    parser.add_argument("--samples", type=int, default=None, help="samples per step (CUDA: 16, CPU: 4)")
    parser.add_argument("--seq-len", type=int, default=None, help="longest sample; the shortest is half of it")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per budget (CUDA: 2, CPU: 1)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100 and H200 SXM: 989)")
    parser.add_argument(
        "--recompute", action="store_true", help="the 3B recipe's full recompute (uniform, one layer at a time)"
    )
    args = parser.parse_args(argv)

    import torch

    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        print("error: no CUDA GPU (use --cpu)", file=sys.stderr)
        return 2
    from megatron_bridge import ModelShape
    from megatron_bridge.param_count import count_parameters
    from slime_search.backends.megatron.actor import ActorConfig, MegatronActor
    from slime_search.backends.megatron.distributed import init_megatron, shutdown
    from slime_search.backends.megatron.loss import LossConfig
    from slime_search.backends.megatron.model import ModelOptions, build_gpt_model
    from slime_search.backends.megatron.optimizer import OptimConfig
    from slime_search.utils.net import free_port
    from tools.gpu_check.shared import samples_of

    # CPU: small enough for a test to run it (the tiny model's cost is its 151,936-wide output layer, not attention)
    budgets = [int(b) for b in (args.budgets or ("2048,4096,8192" if cuda else "64,128,256")).split(",")]
    seq_len = args.seq_len or (2048 if cuda else 64)
    count = args.samples or (16 if cuda else 4)
    steps = args.steps or (2 if cuda else 1)
    init_megatron(0, 1, tp_size=1, master_port=free_port(), seed=1234)
    shape = ModelShape(*(GPU_SHAPE if cuda else CPU_SHAPE))
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    options = ModelOptions(
        params_dtype=torch.bfloat16 if cuda else torch.float32,
        attention_impl=args.attention_impl,
        **(recompute if args.recompute else {}),
    )
    model = build_gpt_model(shape, options)
    if cuda:
        model = model.cuda()
    config = ActorConfig(
        loss=LossConfig(vocab_size=shape.vocab_size),
        optim=OptimConfig(lr=1e-6, use_distributed_optimizer=cuda),
        max_tokens_per_micro_batch=budgets[0],
        probe_tokens=0,  # the step alone, not the policy-shift probe after it
    )
    actor = MegatronActor(model, config)
    samples = samples_of(count, seq_len // 2, seq_len, shape.vocab_size)
    tokens = sum(len(s.tokens) for s in samples)
    params = count_parameters(shape)
    first_step = None
    for budget in budgets:
        actor.config = dataclasses.replace(config, max_tokens_per_micro_batch=budget)
        record = {
            "attention_impl": args.attention_impl,
            "recompute": model.config.recompute_granularity,  # as the built model holds it
            "tokens_per_micro_batch": budget,
            "tokens_per_step": tokens,
        }
        try:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            warm = actor.train_step(samples)
            if first_step is None:  # the same starting weights for every implementation
                first_step = {"loss": warm["loss"], "grad_norm": warm["grad_norm"]}
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(steps):
                actor.train_step(samples)
            if cuda:
                torch.cuda.synchronize()
        except torch.OutOfMemoryError as error:
            record["error"] = f"out of memory: {str(error).splitlines()[0][:200]}"
            print(json.dumps(record), flush=True)
            break
        seconds = (time.perf_counter() - started) / steps
        record.update(
            step_s=round(seconds, 3),
            tokens_per_s=round(tokens / seconds, 1),
            mfu=round(6 * params * tokens / seconds / (args.peak_tflops * 1e12), 4) if cuda else None,
            peak_memory_gib=round(peak_memory_gib(cuda), 2),
            memory="device peak" if cuda else "process peak RSS so far",
            first_step=first_step,
        )
        print(json.dumps(record), flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
