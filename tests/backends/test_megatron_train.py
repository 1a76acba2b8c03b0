"""Megatron actor training steps on CPU: the loss falls on a fixed batch, identically at TP=1 and TP=2."""

import json
from pathlib import Path

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


def _actor_from_hf(rank: int, world: int, port: int, checkpoint: str, tp: int | None = None):
    """Megatron at TP `tp` (default `world`; DP world / TP) with the HF checkpoint's weights, its actor, and the fixed
    batch with its old log-probs: (hf, shape, options, config, actor, samples, old)."""
    from transformers import AutoModelForCausalLM

    from megatron_bridge import ModelShape
    from slime_search.backends.megatron.actor import ActorConfig, MegatronActor
    from slime_search.backends.megatron.distributed import init_megatron
    from slime_search.backends.megatron.loss import LossConfig
    from slime_search.backends.megatron.model import ModelOptions, build_gpt_model, load_hf_weights
    from slime_search.backends.megatron.optimizer import OptimConfig

    init_megatron(rank, world, tp_size=tp or world, master_port=port)
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
    sizes = {p.name: p.stat().st_size for p in (Path(save_dir) / "iter_0000002").iterdir()}
    layout = _gathered_layout(actor)
    history += [actor.train_step(samples) for _ in range(2)]
    fresh = build_gpt_model(shape, options)
    resumed = MegatronActor(fresh, config)
    assert load_actor(resumed, save_dir) == 2
    resumed.offload()  # a colocated run hands the memory over before its first rollout: the loaded state too
    resumed.onload()
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
                    "sizes": sizes,
                    "layout": layout,
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


def _gathered_layout(actor) -> dict:
    """The actor's CheckpointLayout from every rank's parameter counts, as RayTrainGroup.checkpoint_layout makes it."""
    import dataclasses

    from megatron.core import parallel_state

    from slime_search.backends.megatron.checkpoint_size import layout_of_ranks, rank_parameters

    model = actor.model.module
    mine = (parallel_state.get_tensor_model_parallel_rank(), *rank_parameters(model))
    per_rank = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(per_rank, mine)
    return dataclasses.asdict(layout_of_ranks(per_rank, next(model.parameters()).element_size()))


def _layout(record: dict):
    from slime_search.backends.megatron.checkpoint_size import CheckpointLayout

    return CheckpointLayout(**{**record, "slice_parameters": tuple(record["slice_parameters"])})


def assert_checkpoint_bytes(sizes: dict[str, int], layout, checkpoint) -> None:
    """The files of a checkpoint weigh what checkpoint_bytes says of the model as built (within 3%: pickling, the
    metadata), and layout_of_shape predicts that layout from the model's shape alone."""
    from transformers import AutoConfig

    from megatron_bridge import ModelShape, pad_vocab_size
    from slime_search.backends.megatron.checkpoint_size import checkpoint_bytes, layout_of_shape

    shape, tp = ModelShape.from_hf_config(AutoConfig.from_pretrained(checkpoint)), len(layout.slice_parameters)
    assert layout == layout_of_shape(shape, pad_vocab_size(shape.vocab_size, 128, tp), tp, param_bytes=4)
    assert sum(sizes.values()) == pytest.approx(checkpoint_bytes(layout), rel=0.03)
    optimizer_files = sorted(name for name in sizes if name.startswith("optimizer"))
    assert optimizer_files == [f"optimizer_tp{t:02d}.pt" for t in range(tp)]  # one per tensor-parallel slice
    for t, name in enumerate(optimizer_files):
        assert sizes[name] == pytest.approx(8 * layout.slice_parameters[t], rel=0.03)  # two fp32 Adam moments


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
        assert {"optimizer_tp00.pt", "rng_rank00000.pt", "common.pt"} <= set(run_["folder"])
        assert not any("Overwriting" in message for message in run_["warnings"])
        assert run_["left_running"] == []  # the save's write results stayed in the process: no Manager left behind
    for run_ in (tp1, tp2):
        assert_checkpoint_bytes(run_["sizes"], _layout(run_["layout"]), tiny_checkpoint)
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


def _to_legacy_layout(actor, folder: Path) -> None:
    """Rewrite a checkpoint's optimizer state as earlier versions wrote it: every rank its own file."""
    torch.save(actor.optimizer.state_dict(), folder / f"optimizer_rank{torch.distributed.get_rank():05d}.pt")
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        for path in folder.glob("optimizer_tp*.pt"):
            path.unlink()
    torch.distributed.barrier()


def _data_parallel_worker(rank: int, world: int, port: int, checkpoint: str, out_path: str) -> None:
    """TP 1 x DP 2: a step, a checkpoint (and a copy of it in the earlier layout), the next step; then fresh actors
    resume from each checkpoint and take that next step again."""
    from megatron.core import parallel_state

    from slime_search.backends.megatron.actor import MegatronActor
    from slime_search.backends.megatron.checkpoint import iteration_dir, load_actor, save_actor
    from slime_search.backends.megatron.distributed import shutdown
    from slime_search.backends.megatron.model import build_gpt_model
    from slime_search.ray.train_group import split_for_data_parallel

    hf, shape, options, config, actor, samples, old = _actor_from_hf(rank, world, port, checkpoint, tp=1)
    shard = split_for_data_parallel(samples, world)[parallel_state.get_data_parallel_rank()]
    actor.train_step(shard)
    save_dir, legacy_dir = Path(out_path + ".ckpt"), Path(out_path + ".legacy")
    save_actor(actor, save_dir, iteration=1)
    save_actor(actor, legacy_dir, iteration=1)
    _to_legacy_layout(actor, iteration_dir(legacy_dir, 1))
    folder = iteration_dir(save_dir, 1)
    sizes = {p.name: p.stat().st_size for p in folder.iterdir()}
    layout = _gathered_layout(actor)
    legacy_files = sorted(p.name for p in iteration_dir(legacy_dir, 1).glob("optimizer*"))
    next_step = actor.train_step(shard)
    outcome = {"sizes": sizes, "layout": layout, "legacy_files": legacy_files}
    for name, root in (("resumed", save_dir), ("resumed_legacy", legacy_dir)):
        resumed = MegatronActor(build_gpt_model(shape, options), config)
        load_actor(resumed, root)
        again = resumed.train_step(shard)
        outcome[name] = {
            "same_metrics": again == next_step,  # every metric equal, bit for bit
            "same_weights": all(
                torch.equal(a, b)
                for a, b in zip(actor.model.module.parameters(), resumed.model.module.parameters(), strict=True)
            ),
        }
    outcome["at_tp2"] = _resume_error_at_tp2(shape, options, config, save_dir)
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(outcome, handle)
    shutdown()


def _resume_error_at_tp2(shape, options, config, save_dir) -> str:
    """What resuming the TP 1 checkpoint at TP 2 says (the model reshards: a vocabulary padded alike at both sizes;
    the optimizer state does not)."""
    import dataclasses

    from megatron.core import parallel_state

    from slime_search.backends.megatron.actor import MegatronActor
    from slime_search.backends.megatron.checkpoint import load_actor
    from slime_search.backends.megatron.model import build_gpt_model

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model = build_gpt_model(shape, dataclasses.replace(options, make_vocab_size_divisible_by=64))
    try:
        load_actor(MegatronActor(model, config), save_dir)
    except (ValueError, FileNotFoundError) as err:
        return str(err)
    return "resumed"


def test_data_parallel_ranks_write_one_optimizer_file_and_resume_bit_for_bit(tiny_checkpoint, tmp_path):
    out = tmp_path / "dp2.json"
    mp.spawn(_data_parallel_worker, args=(2, free_port(), str(tiny_checkpoint), str(out)), nprocs=2, join=True)
    outcome = json.loads(out.read_text())
    # the two data-parallel ranks hold the same optimizer state: written once; the RNG states per rank
    assert {"optimizer_tp00.pt", "rng_rank00000.pt", "rng_rank00001.pt"} <= set(outcome["sizes"])
    assert_checkpoint_bytes(outcome["sizes"], _layout(outcome["layout"]), tiny_checkpoint)
    assert outcome["legacy_files"] == ["optimizer_rank00000.pt", "optimizer_rank00001.pt"]
    # both ranks load the one file (and a checkpoint of the earlier layout its own files): the next step is the same
    assert outcome["resumed"] == {"same_metrics": True, "same_weights": True}
    assert outcome["resumed_legacy"] == {"same_metrics": True, "same_weights": True}
    # the optimizer state of one slice does not fit two: refused, saying which size it was saved at
    assert "tensor-parallel size 1: resume with --tensor-model-parallel-size 1" in outcome["at_tp2"]


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
