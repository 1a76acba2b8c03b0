"""Weight sync by disk: trained Megatron shards (TP=2) -> HF checkpoint -> a running CPU engine; and the streamed\nbuckets the other transports push hold exactly the same weights."""

import asyncio
import json
import time

import pytest
import torch
import torch.multiprocessing as mp

from slime_search.utils.net import free_port
from slime_search.utils.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
BUCKET_BYTES = 64 * 1024
TOKENS = [151644, 872, 198, 9707, 1879, 0, 151645, 198, 151644, 77091, 198, 3838, 374, 419]


def _sync_worker(rank, world, port, checkpoint, out_dir):
    from transformers import AutoModelForCausalLM

    from megatron_bridge import ModelShape, megatron_to_hf
    from slime_search.backends.megatron.actor import ActorConfig, MegatronActor
    from slime_search.backends.megatron.distributed import init_megatron, shutdown
    from slime_search.backends.megatron.loss import LossConfig
    from slime_search.backends.megatron.model import ModelOptions, build_gpt_model, load_hf_weights, uses_te_names
    from slime_search.backends.megatron.optimizer import OptimConfig
    from slime_search.types import TrainSample
    from slime_search.weight_sync.disk import write_hf_checkpoint
    from slime_search.weight_sync.gather import gather_full_megatron_state, iter_hf_buckets

    init_megatron(rank, world, tp_size=world, master_port=port)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    shape, options = ModelShape.from_hf_config(hf.config), ModelOptions.from_hf_config(hf.config)
    model = build_gpt_model(shape, options)
    load_hf_weights(model, hf.state_dict(), shape, options)
    config = ActorConfig(loss=LossConfig(loss_type="sft", vocab_size=shape.vocab_size), optim=OptimConfig(lr=1e-2))
    actor = MegatronActor(model, config)
    sample = TrainSample(TOKENS, 5, [1] * 5)
    before = actor.compute_log_probs([sample])[0]
    actor.train_step([sample])
    after = actor.compute_log_probs([sample])[0]
    full = gather_full_megatron_state(actor.local_state_dict())
    te_names = uses_te_names(model)
    # what the broadcast and tensor-handle transports push: gathered and renamed unit by unit, in buckets
    buckets = list(iter_hf_buckets(actor.local_state_dict(), shape, te_names, bucket_bytes=BUCKET_BYTES))
    if rank == 0:
        write_hf_checkpoint(full, shape, checkpoint, f"{out_dir}/step_1", te_names=te_names)
        whole = megatron_to_hf(full, shape, te_names=te_names)
        if shape.tie_word_embeddings:
            whole.pop("lm_head.weight")
        streamed = [item for bucket in buckets for item in bucket]
        report = {
            "before": before,
            "after": after,
            "streamed_names": [name for name, _ in streamed],
            "whole_names": list(whole),
            "streamed_equal": all(torch.equal(tensor, whole[name]) for name, tensor in streamed),
            "bucket_sizes": [[t.numel() * t.element_size() for _, t in bucket] for bucket in buckets],
        }
        with open(f"{out_dir}/log_probs.json", "w") as handle:
            json.dump(report, handle)
    shutdown()


def hf_log_probs(path, tokens, response_length):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([tokens])).logits[0], -1)
    start = len(tokens) - response_length
    return [lp[start + i - 1, t].item() for i, t in enumerate(tokens[start:])]


def test_trained_weights_reach_the_engine(tiny_checkpoint, tmp_path):
    from slime_search.weight_sync.disk import update_engines_from_disk

    mp.spawn(_sync_worker, args=(2, free_port(), str(tiny_checkpoint), str(tmp_path)), nprocs=2, join=True)
    logged = json.loads((tmp_path / "log_probs.json").read_text())
    synced = tmp_path / "step_1"
    assert not (tmp_path / "step_1.partial").exists()
    # the written checkpoint is the trained policy: HF on it reproduces the actor's post-step log-probs
    assert hf_log_probs(synced, TOKENS, 5) == pytest.approx(logged["after"], abs=1e-4)
    assert max(abs(a - b) for a, b in zip(logged["after"], logged["before"], strict=True)) > 1e-2
    # streaming the gathered TP shards unit by unit gives exactly the whole-model conversion, in small buckets
    assert logged["streamed_names"] == logged["whole_names"] and logged["streamed_equal"]
    assert len(logged["bucket_sizes"]) > 3
    assert all(sum(sizes) <= BUCKET_BYTES or len(sizes) == 1 for sizes in logged["bucket_sizes"])
    argv = ["-m", "slime_search.engines.cpu_engine_server", "--model-path", str(tiny_checkpoint), "--port", "0"]
    with ServerProcess(argv) as engine:
        versions = asyncio.run(update_engines_from_disk([engine.url], str(synced), "1"))
        assert versions == ["1"]
        import httpx

        out = httpx.post(
            f"{engine.url}/generate",
            json={
                "input_ids": TOKENS[:-5],
                "sampling_params": {"max_new_tokens": 5, "temperature": 1.0},
                "return_logprob": True,
            },
            timeout=60,
        ).json()
        assert out["meta_info"]["weight_version"] == "1"
        served = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        expected = hf_log_probs(synced, TOKENS[:-5] + out["output_ids"], len(out["output_ids"]))
        assert served == pytest.approx(expected, abs=1e-4)


class RefusingBroadcaster:
    """Rank 0's broadcaster when an engine refuses the first bucket."""

    def push_buckets(self, buckets, weight_version):
        next(iter(buckets))
        raise RuntimeError("engine refused the bucket")


def _failed_push_worker(rank, world, port, checkpoint, out_dir):
    from slime_search.backends.megatron.actor import ActorConfig
    from slime_search.backends.megatron.distributed import shutdown
    from slime_search.ray.train_group import ModelSource, TrainRank
    from slime_search.weight_sync.broadcast import BroadcastConfig

    trainer = TrainRank(rank, world, world)
    trainer.init_distributed("127.0.0.1", port)
    trainer.load_models(ModelSource(checkpoint), ActorConfig())
    trainer.broadcast_config = BroadcastConfig("gloo", bucket_bytes=BUCKET_BYTES)
    trainer.broadcaster = RefusingBroadcaster() if rank == 0 else None
    try:
        outcome = repr(trainer.broadcast_weights("1"))
    except RuntimeError as err:
        outcome = str(err)
    # the tensor-parallel peers are still in step: a whole new stream of collective gathers completes on both
    buckets_after = sum(1 for _ in trainer._hf_buckets(BUCKET_BYTES))
    with open(f"{out_dir}/rank{rank}.json", "w") as handle:
        json.dump({"outcome": outcome, "buckets_after": buckets_after}, handle)
    shutdown()


def test_a_failed_broadcast_leaves_no_tensor_parallel_rank_waiting(tiny_checkpoint, tmp_path):
    context = mp.spawn(
        _failed_push_worker, args=(2, free_port(), str(tiny_checkpoint), str(tmp_path)), nprocs=2, join=False
    )
    deadline = time.monotonic() + 240
    while not context.join(timeout=5):
        if time.monotonic() > deadline:  # rank 1 blocked in a gather rank 0 never joined
            for process in context.processes:
                process.kill()
            pytest.fail("a rank was left waiting after the failed push")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0]["outcome"] == "engine refused the bucket" and results[1]["outcome"] == "None"
    assert results[0]["buckets_after"] == results[1]["buckets_after"] > 3
