"""The training loop on one device, colocated, driven piece by piece without Ray: one JSON line per GRPO step.

    python -m benchmarks.gpu_kit_loop                # CUDA: a Qwen2.5-0.5B-shaped model (random weights), fp32
    python -m benchmarks.gpu_kit_loop --cpu          # CPU: the tiny Qwen2

Part (c) of `benchmarks.gpu_kit`. The pieces are the run's own: the CPU engine server (the stand-in for SGLang, here
on the actor's device) serves /generate; the Megatron actor (its default attention: TransformerEngine where
installed, else PackedAttention) computes old log-probs and takes a GRPO step; the weights are gathered to HF names
and pushed by the broadcast transport (gloo: the engine side of NCCL and of CUDA IPC handles is SGLang's, which this
machine may not have). Colocation as the run does it: the actor hands its memory to the host while the engine
generates; the engine releases its weights while the actor trains, resumes them, and serves only once the push has
refilled them. What runs only under Ray (the placement group, the actor group's remote calls) is not exercised.

Per step: the version the engine served while sampling (`rollout/weight_version`), the version it serves after the
push (`weight_version`), the trainer's log-probs of the engine's tokens against the engine's own
(`train/train_rollout_logprob_abs_diff`, small and flat when the push is right), the push's seconds (`time/sync_s`).
fp32 on both sides, so the log-prob difference measures the loop, not bf16 rounding.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

GPU_MODEL = {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2, "intermediate_size": 4864}


def rollout(url: str, prompts: list[list[int]], n: int, max_new_tokens: int) -> list[dict]:
    """n samples per prompt from the engine, concurrently (the engine batches them): the prompt, the answer."""
    import httpx

    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": max_new_tokens}

    async def one(client, prompt):
        body = {"input_ids": prompt, "sampling_params": params, "return_logprob": True}
        answer = await client.post(f"{url}/generate", json=body, timeout=600)
        answer.raise_for_status()
        return {"prompt": prompt, **answer.json()}

    async def every():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client, p) for p in prompts for _ in range(n)))

    return asyncio.run(every())


def train_samples(answers: list[dict], n: int):
    """TrainSamples with GRPO advantages of a reward the policy can move: the share of even token ids."""
    import torch

    from slime_search.algo.advantages import grpo_advantages
    from slime_search.types import TrainSample

    rewards, samples = [], []
    for answer in answers:
        response = [entry[1] for entry in answer["meta_info"]["output_token_logprobs"]]
        rewards.append(sum(1 for t in response if t % 2 == 0) / len(response))
        log_probs = [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]
        samples.append(TrainSample(answer["prompt"] + response, len(response), [1] * len(response), 0.0, log_probs))
    advantages = grpo_advantages(torch.tensor(rewards), torch.arange(len(answers)) // n)
    for sample, advantage in zip(samples, advantages.tolist(), strict=True):
        sample.advantage = advantage
    return samples, sum(rewards) / len(rewards)


def post(url: str, path: str, body: dict | None = None) -> None:
    import httpx

    httpx.post(f"{url}{path}", json=body or {}, timeout=600).raise_for_status()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=None, help="CUDA: 4, CPU: 2")
    parser.add_argument("--n-samples-per-prompt", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    args = parser.parse_args(argv)

    import torch

    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        print("error: no CUDA GPU (use --cpu)", file=sys.stderr)
        return 2
    from transformers import AutoModelForCausalLM

    from megatron_bridge import ModelShape
    from slime_search.backends.megatron.actor import ActorConfig, MegatronActor
    from slime_search.backends.megatron.distributed import init_megatron, shutdown
    from slime_search.backends.megatron.loss import LossConfig
    from slime_search.backends.megatron.model import ModelOptions, build_gpt_model, load_hf_weights, uses_te_names
    from slime_search.backends.megatron.optimizer import OptimConfig
    from slime_search.models.tiny_qwen import TinyQwenConfig, save_tiny_checkpoint
    from slime_search.utils.net import free_port
    from slime_search.utils.server_process import ServerProcess
    from slime_search.weight_sync.broadcast import BroadcastConfig, WeightBroadcaster
    from slime_search.weight_sync.gather import iter_hf_buckets
    from slime_search.weight_sync.transport_base import served_versions, weight_update_session

    device = "cuda" if cuda else "cpu"
    max_new = args.max_new_tokens or (32 if cuda else 8)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = save_tiny_checkpoint(Path(tmp) / "policy", TinyQwenConfig(**(GPU_MODEL if cuda else {})))
        engine_argv = ["-m", "slime_search.engines.cpu_engine_server", "--model-path", str(checkpoint)]
        engine_argv += ["--port", "0", "--device", device, "--weight-version", "0"]
        init_megatron(0, 1, tp_size=1, master_port=free_port())
        hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        shape, options = ModelShape.from_hf_config(hf.config), ModelOptions.from_hf_config(hf.config)
        model = build_gpt_model(shape, options)
        load_hf_weights(model, hf.state_dict(), shape, options)
        del hf
        model = model.to(device)
        config = ActorConfig(
            loss=LossConfig(vocab_size=shape.vocab_size, use_tis=True), optim=OptimConfig(lr=1e-5), probe_tokens=0
        )
        actor = MegatronActor(model, config)
        te_names = uses_te_names(actor.model.module)
        gen = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(0, 150_000, (16,), generator=gen).tolist() for _ in range(args.prompts or (4 if cuda else 2))
        ]
        with ServerProcess(engine_argv, timeout=600) as engine:
            broadcaster = WeightBroadcaster(BroadcastConfig("gloo"))
            broadcaster.connect([engine.url], [1], "127.0.0.1", free_port())
            try:
                actor.offload()  # the engine generates first
                for step in range(1, args.steps + 1):
                    started = time.perf_counter()
                    answers = rollout(engine.url, prompts, args.n_samples_per_prompt, max_new)
                    rollout_s = time.perf_counter() - started
                    versions = {a["meta_info"]["weight_version"] for a in answers}
                    post(engine.url, "/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
                    actor.onload()
                    samples, reward = train_samples(answers, args.n_samples_per_prompt)
                    started = time.perf_counter()
                    for sample, old in zip(samples, actor.compute_log_probs(samples), strict=True):
                        sample.old_log_probs = old
                    metrics = actor.train_step(samples)
                    train_s = time.perf_counter() - started
                    post(engine.url, "/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})
                    started = time.perf_counter()
                    state = {
                        name: tensor.detach().cpu()  # gloo sends from host memory
                        for bucket in iter_hf_buckets(actor.local_state_dict(), shape, te_names, 512 * 1024**2)
                        for name, tensor in bucket
                    }
                    with weight_update_session([engine.url]):
                        broadcaster.push(state, str(step))
                    sync_s = time.perf_counter() - started
                    served = asyncio.run(served_versions([engine.url]))
                    actor.offload()
                    record = {
                        "step": step,
                        "weight_version": served[0],
                        "rollout/weight_version": sorted(versions),
                        "train/train_rollout_logprob_abs_diff": metrics["train_rollout_logprob_abs_diff"],
                        "time/sync_s": round(sync_s, 3),
                        "time/rollout_s": round(rollout_s, 3),
                        "time/train_s": round(train_s, 3),
                        "reward": round(reward, 4),
                        "loss": metrics["loss"],
                        "grad_norm": metrics["grad_norm"],
                        "samples": len(samples),
                        "device": device,
                        "attention": "te" if te_names else "packed",
                    }
                    print(json.dumps(record), flush=True)
            finally:
                broadcaster.close()
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
