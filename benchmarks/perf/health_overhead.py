"""What the health signals cost a training step, measured in one process on CPU.
It times the Megatron actor's step with and without them (the entropy of every trained token and the post-update probe).
It also times the driver's batch signals. The model and batch have the miniature's shape. The variants alternate so that
the machine's drift falls on both.

    python -m benchmarks.perf.health_overhead --model RUN/policy [--steps 12] [--samples 64] [--response 120] \
        [--probe-tokens 512]

"Without" is the actor with the probe off (`probe_tokens=0`) and the entropy replaced by zeros, i.e. the step as it
was before the signals; prints the medians and the difference as a share of the step.

Its figures: `docs/benchmarks/health.md`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time


def batch(samples: int, prompt: int, response: int, vocab: int, seed: int = 0):
    """A GRPO batch of the miniature's shape: responses with an observation span (mask 0) in the middle."""
    from slime_search.types import TrainSample

    rng = random.Random(seed)
    out = []
    for _ in range(samples):
        tokens = [rng.randrange(vocab) for _ in range(prompt + response)]
        mask = [1] * response
        mask[response // 3 : response // 2] = [0] * (response // 2 - response // 3)
        versions = [0 if m else -1 for m in mask]
        lps = [-rng.random() for _ in range(response)]
        advantage = rng.choice([-1.0, 0.0, 1.0])
        out.append(TrainSample(tokens, response, mask, advantage, lps, list(lps), token_versions=versions))
    return out


def timed_step(actor, samples) -> float:
    started = time.perf_counter()
    actor.train_step(samples)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an HF checkpoint (the miniature's RUN/policy)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per variant (after one warm-up each)")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=60)
    parser.add_argument("--response", type=int, default=120)
    parser.add_argument("--max-tokens-per-gpu", type=int, default=512)
    parser.add_argument("--probe-tokens", type=int, default=512, help="--health-probe-tokens of the run with them")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from megatron_bridge import ModelShape
    from slime_search.backends.megatron import loss as loss_module
    from slime_search.backends.megatron.actor import ActorConfig, MegatronActor
    from slime_search.backends.megatron.distributed import init_megatron
    from slime_search.backends.megatron.loss import LossConfig
    from slime_search.backends.megatron.model import ModelOptions, build_gpt_model, load_hf_weights
    from slime_search.backends.megatron.optimizer import OptimConfig
    from slime_search.health.signals import batch_signals
    from slime_search.utils.net import free_port

    init_megatron(0, 1, tp_size=1, master_port=free_port())
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    shape, options = ModelShape.from_hf_config(hf.config), ModelOptions.from_hf_config(hf.config)
    actors = {}
    for name, probe in (("with", args.probe_tokens), ("without", 0)):
        model = build_gpt_model(shape, options)
        load_hf_weights(model, hf.state_dict(), shape, options)
        config = ActorConfig(
            loss=LossConfig(use_tis=True, vocab_size=shape.vocab_size),
            optim=OptimConfig(lr=0.0),  # the weights stay put: every step does the same work
            max_tokens_per_micro_batch=args.max_tokens_per_gpu,
            probe_tokens=probe,
        )
        actors[name] = MegatronActor(model, config)
    samples = batch(args.samples, args.prompt, args.response, shape.vocab_size)
    for sample, old in zip(samples, actors["with"].compute_log_probs(samples), strict=True):
        sample.old_log_probs = old
    real_entropy = loss_module.entropy

    def no_entropy(rows, temperature, vocab_size):  # the step before the signals: no entropy without its term
        return torch.zeros(rows.shape[0], dtype=torch.float32)

    times: dict[str, list[float]] = {"with": [], "without": []}
    for round_ in range(args.steps + 1):
        for name in ("with", "without"):
            loss_module.entropy = real_entropy if name == "with" else no_entropy
            elapsed = timed_step(actors[name], samples)
            if round_:  # the first round warms both up
                times[name].append(elapsed)
    loss_module.entropy = real_entropy
    started = time.perf_counter()
    for _ in range(args.steps):
        batch_signals(samples, 0, 2.0)
    signals = (time.perf_counter() - started) / args.steps
    with_s, without_s = statistics.median(times["with"]), statistics.median(times["without"])
    tokens = sum(len(s.tokens) for s in samples)
    print(
        f"batch: {args.samples} samples, {tokens} tokens; probe {args.probe_tokens} tokens; {args.steps} steps per variant"
    )
    print(f"actor step with the signals     {with_s:.3f} s")
    print(f"actor step without them         {without_s:.3f} s")
    print(f"driver's batch signals          {signals * 1000:.1f} ms")
    extra = with_s - without_s + signals
    print(f"added per step                  {extra:.3f} s ({100 * extra / without_s:+.1f}% of the actor step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
