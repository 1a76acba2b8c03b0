"""Megatron actor training steps on CPU: the loss falls on a fixed batch, identically at TP=1 and TP=2."""

import json

import pytest
import torch
import torch.multiprocessing as mp

from slime_search.utils.net import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def fixed_batch():
    from slime_search.types import TrainSample

    gen = torch.Generator().manual_seed(7)
    samples = []
    for i, (prompt, response) in enumerate([(5, 7), (3, 9), (8, 4), (4, 6)]):
        tokens = torch.randint(0, 150_000, (prompt + response,), generator=gen).tolist()
        mask = [1] * response
        mask[1:3] = [0, 0]  # an "observation" inside the response
        samples.append(TrainSample(tokens, response, mask, advantage=[1.0, -1.0, 0.5, -0.5][i]))
    return samples


def _actor_from_hf(rank: int, world: int, port: int, checkpoint: str):
    """Megatron at TP `world` with the HF checkpoint's weights, its actor, and the fixed batch with its old
    log-probs: (hf, shape, options, config, actor, samples, old)."""
    from transformers import AutoModelForCausalLM

    from megatron_bridge import ModelShape
    from slime_search.backends.megatron.actor import ActorConfig, MegatronActor
    from slime_search.backends.megatron.distributed import init_megatron
    from slime_search.backends.megatron.loss import LossConfig
    from slime_search.backends.megatron.model import ModelOptions, build_gpt_model, load_hf_weights
    from slime_search.backends.megatron.optimizer import OptimConfig

    init_megatron(rank, world, tp_size=world, master_port=port)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    shape, options = ModelShape.from_hf_config(hf.config), ModelOptions.from_hf_config(hf.config)
    model = build_gpt_model(shape, options)
    load_hf_weights(model, hf.state_dict(), shape, options)
    config = ActorConfig(
        loss=LossConfig(eps_clip=0.2, eps_clip_high=0.28, vocab_size=shape.vocab_size),
        optim=OptimConfig(lr=1e-3, clip_grad=1.0),
        max_tokens_per_micro_batch=24,
    )
    actor = MegatronActor(model, config)
    samples = fixed_batch()
    old = actor.compute_log_probs(samples)
    for sample, lp in zip(samples, old, strict=True):
        sample.old_log_probs = lp
    return hf, shape, options, config, actor, samples, old


def _train_worker(rank: int, world: int, port: int, checkpoint: str, out_path: str) -> None:
    from slime_search.backends.megatron.actor import MegatronActor
    from slime_search.backends.megatron.distributed import shutdown
    from slime_search.backends.megatron.model import build_gpt_model, load_hf_weights

    hf, shape, options, config, actor, samples, old = _actor_from_hf(rank, world, port, checkpoint)
    history = [actor.train_step(samples) for _ in range(2)]
    # checkpoint after 2 steps, continue 2 more; then a fresh actor resumes from the checkpoint
    from slime_search.backends.megatron.checkpoint import load_actor, save_actor

    save_dir = out_path + ".ckpt"
    warnings = _megatron_warnings()
    from pathlib import Path

    from slime_search.backends.megatron.checkpoint import partial_dir

    if rank == 0:  # a save of iteration 2 cut short earlier left its partial folder
        partial_dir(save_dir, 2).mkdir(parents=True)
        (partial_dir(save_dir, 2) / "stale.pt").write_text("")
    torch.distributed.barrier()
    save_actor(actor, save_dir, iteration=2, extra_files={"rollout_state.json": "{}"})
    import multiprocessing

    left_running = [child.name for child in multiprocessing.active_children()]  # no Manager started for the save
    saved = sorted(p.name for p in Path(save_dir).iterdir())
    folder = sorted(p.name for p in (Path(save_dir) / "iter_0000002").iterdir())
    history += [actor.train_step(samples) for _ in range(2)]
    fresh = build_gpt_model(shape, options)
    resumed = MegatronActor(fresh, config)
    assert load_actor(resumed, save_dir) == 2
    after_resume = [resumed.train_step(samples) for _ in range(2)]
    from slime_search.backends.megatron.actor import ReferenceModel

    reference = build_gpt_model(shape, options)
    load_hf_weights(reference, hf.state_dict(), shape, options)
    ref_log_probs = ReferenceModel(reference, config).compute_log_probs(samples)
    trained_log_probs = actor.compute_log_probs(samples)
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(
                {
                    "history": history,
                    "old": old,
                    "resumed": after_resume,
                    "ref": ref_log_probs,
                    "trained": trained_log_probs,
                    "saved": saved,
                    "folder": folder,
                    "warnings": warnings,
                    "left_running": left_running,
                },
                handle,
            )
    shutdown()


def assert_hf_log_probs(hf, per_sample: list[list[float]]) -> None:
    """The actor's log-probs of the fixed batch are HF's at T = 1 on the same tokens."""
    for sample, lp in zip(fixed_batch(), per_sample, strict=True):
        with torch.no_grad():
            log_probs = torch.log_softmax(hf(torch.tensor([sample.tokens])).logits[0], -1)
        start = len(sample.tokens) - sample.response_length
        expected = [log_probs[start + i - 1, t].item() for i, t in enumerate(sample.tokens[start:])]
        assert lp == pytest.approx(expected, abs=1e-4)


def _megatron_warnings() -> list[str]:
    """Collects what Megatron's checkpointing logs at WARNING (it warns when it saves into a folder with files)."""
    import logging

    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logging.getLogger("megatron.core.dist_checkpointing").addHandler(Collect(level=logging.WARNING))
    return seen


def run(tp, checkpoint, tmp_path):
    out = tmp_path / f"tp{tp}.json"
    mp.spawn(_train_worker, args=(tp, free_port(), str(checkpoint), str(out)), nprocs=tp, join=True)
    return json.loads(out.read_text())


def test_grpo_steps_lower_the_loss_and_match_across_tp(tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    tp1, tp2 = run(1, tiny_checkpoint, tmp_path), run(2, tiny_checkpoint, tmp_path)
    losses1 = [h["loss"] for h in tp1["history"]]
    losses2 = [h["loss"] for h in tp2["history"]]
    # on-policy start: ratio 1, so the first surrogate is -mean(advantage) over sequences = 0 here
    assert abs(losses1[0]) < 1e-6
    assert losses1[-1] < losses1[0] - 1e-3 and all(b <= a + 1e-6 for a, b in zip(losses1, losses1[1:], strict=False))
    assert losses2 == pytest.approx(losses1, abs=1e-5)
    assert [h["grad_norm"] for h in tp2["history"]] == pytest.approx([h["grad_norm"] for h in tp1["history"]], rel=1e-4)
    # the checkpoint was written into an empty folder and renamed into place, the tracker last; a stale partial
    # folder of the same iteration was replaced, and Megatron never saved over existing files
    for run_ in (tp1, tp2):
        assert run_["saved"] == ["iter_0000002", "latest_checkpointed_iteration.txt"]
        assert "rollout_state.json" in run_["folder"] and "stale.pt" not in run_["folder"]
        assert {"optimizer_rank00000.pt", "rng_rank00000.pt", "common.pt"} <= set(run_["folder"])
        assert not any("Overwriting" in message for message in run_["warnings"])
        assert run_["left_running"] == []  # the save's write results stayed in the process: no Manager left behind
    # resuming from the step-2 checkpoint (model + Adam state) reproduces steps 3 and 4
    for run_ in (tp1, tp2):
        assert [h["loss"] for h in run_["resumed"]] == pytest.approx([h["loss"] for h in run_["history"][2:]], abs=1e-6)
    # the reference (frozen initial weights) reproduces the initial log-probs; the trained policy moved away
    for run_ in (tp1, tp2):
        assert [x for lp in run_["ref"] for x in lp] == pytest.approx([x for lp in run_["old"] for x in lp], abs=1e-6)
        assert (
            max(
                abs(a - b) for t, o in zip(run_["trained"], run_["old"], strict=True) for a, b in zip(t, o, strict=True)
            )
            > 1e-2
        )
    # the actor's log-probs are HF's at T = 1 on the same tokens
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    assert_hf_log_probs(hf, tp2["old"])


def test_rng_state_round_trips():
    import random

    import numpy as np

    from slime_search.backends.megatron.checkpoint import rng_state, set_rng_state

    state = rng_state()
    draws = (random.random(), np.random.rand(), torch.rand(3))
    set_rng_state(state)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert draws[0] == again[0] and draws[1] == again[1] and torch.equal(draws[2], again[2])


def _qwen3_worker(rank: int, world: int, port: int, checkpoint: str, out_path: str) -> None:
    from slime_search.backends.megatron.distributed import shutdown

    hf, shape, options, config, actor, samples, old = _actor_from_hf(rank, world, port, checkpoint)
    history = [actor.train_step(samples) for _ in range(2)]
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump({"old": old, "history": history}, handle)
    shutdown()


def test_a_qwen3_actor_gives_hfs_log_probs_at_tp2_and_trains(tiny_qwen3_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "qwen3.json"
    mp.spawn(_qwen3_worker, args=(2, free_port(), str(tiny_qwen3_checkpoint), str(out)), nprocs=2, join=True)
    result = json.loads(out.read_text())
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_checkpoint, dtype=torch.float32).eval()
    assert_hf_log_probs(hf, result["old"])
    losses = [h["loss"] for h in result["history"]]
    assert abs(losses[0]) < 1e-6 and losses[1] < losses[0] - 1e-4  # on-policy start, then the loss falls
