"""Sequence parallelism's replicated layer norms: their gradients are summed across tensor-parallel ranks.

With sequence parallelism each TP rank runs the layer norms on its part of the sequence only, so each holds a partial
gradient of weights every rank keeps whole; a step that reduces over data-parallel ranks alone leaves the replicas to
drift apart. Sequence parallelism itself cannot run on CPU (Megatron's torch norm, the only one without Apex or
TransformerEngine, refuses it: megatron/core/transformer/torch_norm.py), so the test gives the actor's gradient
finalisation per-rank partial gradients of a norm tagged as sequence-parallel, at TP 2 over gloo, and checks that both
ranks end with their sum. Packs padded to the TP size are tested in test_megatron_loss.py.
"""

import json
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from slime_search.utils.net import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _worker(rank: int, world: int, port: int, checkpoint: str, out_path: str) -> None:
    from transformers import AutoConfig

    from megatron_bridge import ModelShape
    from slime_search.backends.megatron.actor import ActorConfig, MegatronActor
    from slime_search.backends.megatron.distributed import init_megatron, shutdown
    from slime_search.backends.megatron.model import ModelOptions, build_gpt_model

    init_megatron(rank, world, tp_size=world, master_port=port)
    hf_config = AutoConfig.from_pretrained(checkpoint)
    model = build_gpt_model(ModelShape.from_hf_config(hf_config), ModelOptions.from_hf_config(hf_config))
    actor = MegatronActor(model, ActorConfig())
    norm = model.decoder.final_layernorm.weight
    model.config.sequence_parallel = True  # as a model built with --sequence-parallel (which tags its norms)
    norm.sequence_parallel = True
    actor.model.zero_grad_buffer()
    norm.main_grad.fill_(rank + 1.0)  # rank r's part of the sequence contributed r + 1
    actor._finalize_grads()
    with open(f"{out_path}.{rank}", "w") as handle:
        json.dump({"grad": norm.main_grad.unique().tolist()}, handle)
    shutdown()


def test_partial_layer_norm_gradients_are_summed_across_tensor_parallel_ranks(tiny_checkpoint, tmp_path):
    out = str(tmp_path / "grads")
    mp.spawn(_worker, args=(2, free_port(), str(tiny_checkpoint), out), nprocs=2, join=True)
    grads = [json.loads(Path(f"{out}.{rank}").read_text())["grad"] for rank in range(2)]
    assert grads == [[3.0], [3.0]]  # 1 + 2 on both ranks, not 1 and 2
