"""Every torch_dist checkpoint loads into every layer spec: a checkpoint of the local spec (what the converter writes on
CPU) into TransformerEngine's spec, one carrying TransformerEngine's extra state into the local spec, one written
with no extra state at all; and what a checkpoint really lacks still fails, naming it.

TransformerEngine does not run on CPU, so its spec's sharded state dict is made as its modules make it, read from
megatron-core 0.16.1 and TransformerEngine 2.11 (the GPU pins): a TE module's `state_dict` is the local module's plus
an `_extra_state` (TransformerEngineBaseModule and te.ops' BasicOperation.get_extra_state: an empty uint8 tensor
without FP8, pickled FP8 metadata with it), and megatron-core wraps every `_extra_state` as a ShardedObject
(transformer/utils.py make_sharded_tensors_for_checkpoint, for TE's linears and for TENorm through
sharded_state_dict_default). So the test gives the local modules TE's `get_extra_state` and lets megatron-core's own
code build the keys, replica ids and layer offsets. The local linears already keep an (empty) `_extra_state` under
the same keys; TENorm's q/k RMSNorm (Qwen3) keeps one where the local torch norm keeps none; TEDotProductAttention
keeps none (its sharded_state_dict is empty unless the softmax is learnable).
"""

import json
import pickle

import pytest
import torch
import torch.multiprocessing as mp

from slime_search.utils.net import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TE_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "q_layernorm", "k_layernorm")
FP8_METADATA = {"forward": {"recipe": "delayed scaling", "amax_history_len": 16}}  # what an FP8 run's extra state holds


class TransformerEngineExtraState:
    """What a TransformerEngine module adds to the module it stands in for: its extra state."""

    payload: dict | None = None  # None: a run without FP8 (an empty tensor)

    def get_extra_state(self) -> torch.Tensor:
        if self.payload is None:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(pickle.dumps(self.payload)), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        self.loaded_extra_state = state


def as_transformer_engine_spec(model, payload: dict | None = None):
    """`model` with the extra state TransformerEngine's modules of its layers would keep (a q/k norm the shape has not
    is an IdentityOp in both specs)."""
    from megatron.core.transformer.identity_op import IdentityOp

    for name, module in model.named_modules():
        if name.rpartition(".")[2] in TE_MODULES and not isinstance(module, IdentityOp):
            module.__class__ = type(f"TE{type(module).__name__}", (TransformerEngineExtraState, type(module)), {})
            module.payload = payload
    return model


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def _same_weights(model, reference: dict[str, torch.Tensor]) -> bool:
    mine = _weights(model)
    return mine.keys() == reference.keys() and all(torch.equal(mine[k], reference[k]) for k in reference)


def _save_leaving_out(model, folder, left_out) -> None:
    """A checkpoint of `model` without the entries whose names `left_out` accepts (as a converter that keeps no extra
    state writes one)."""
    from megatron.core import dist_checkpointing

    from slime_search.backends.megatron.checkpoint import _finish_save, _start_save, _write_results_in_process

    sharded = {k: v for k, v in model.sharded_state_dict(prefix="").items() if not left_out(k)}
    _write_results_in_process()
    dist_checkpointing.save(sharded, str(_start_save(folder, 0)))
    _finish_save(folder, 0)


def _family_results(family: str, hf_dir: str, tmp: str) -> dict:
    """Each way a checkpoint of `family` can meet a spec; True where the model then holds the HF weights."""
    from transformers import AutoConfig

    from megatron_bridge import ModelShape
    from megatron_bridge.hf_io import read_hf_state
    from slime_search.backends.megatron.checkpoint import load_model, save_model
    from slime_search.backends.megatron.model import ModelOptions, build_gpt_model, load_hf_weights

    config = AutoConfig.from_pretrained(hf_dir)
    shape, options = ModelShape.from_hf_config(config), ModelOptions.from_hf_config(config)

    def built(te: bool = False, payload: dict | None = None):
        model = build_gpt_model(shape, options)
        return as_transformer_engine_spec(model, payload) if te else model

    local = built()
    load_hf_weights(local, read_hf_state(hf_dir), shape, options)
    hf_weights = _weights(local)
    converted = f"{tmp}/{family}_local"
    save_model(local, converted, iteration=0)  # what tools/convert_hf_to_torch_dist.py writes on CPU
    results = {}
    te = built(te=True)
    added = set(te.sharded_state_dict(prefix="")) - set(local.sharded_state_dict(prefix=""))
    results["te_spec_adds"] = sorted({k.split(".", 3)[3] for k in added})  # less "decoder.layers.N."
    load_model(te, converted)
    results["local_into_te"] = _same_weights(te, hf_weights)
    plain = built()
    load_model(plain, converted)
    results["local_into_local"] = _same_weights(plain, hf_weights)

    fp8 = built(te=True, payload=FP8_METADATA)  # a TE checkpoint whose modules' extra state is filled
    load_model(fp8, converted)
    save_model(fp8, f"{tmp}/{family}_te", iteration=0)
    plain = built()
    load_model(plain, f"{tmp}/{family}_te")
    results["te_into_local"] = _same_weights(plain, hf_weights)
    te = built(te=True)
    load_model(te, f"{tmp}/{family}_te")
    results["te_into_te"] = _same_weights(te, hf_weights)
    restored = te.decoder.layers[0].self_attention.linear_qkv.loaded_extra_state
    results["te_extra_state_restored"] = pickle.loads(restored.numpy().tobytes()) == FP8_METADATA

    _save_leaving_out(local, f"{tmp}/{family}_bare", lambda name: name.endswith("_extra_state"))
    for spec in ("local", "te"):
        model = built(te=spec == "te")
        load_model(model, f"{tmp}/{family}_bare")
        results[f"no_extra_state_into_{spec}"] = _same_weights(model, hf_weights)

    _save_leaving_out(local, f"{tmp}/{family}_no_norm", lambda name: name == "decoder.final_layernorm.weight")
    try:
        load_model(built(te=True), f"{tmp}/{family}_no_norm")
        results["missing_weight"] = "loaded"
    except KeyError as err:
        results["missing_weight"] = str(err)
    return results


def _spec_worker(rank: int, world: int, port: int, checkpoints: dict, tmp: str, out_path: str) -> None:
    from slime_search.backends.megatron.distributed import init_megatron, shutdown

    init_megatron(rank, world, tp_size=world, master_port=port)
    outcome = {family: _family_results(family, hf_dir, tmp) for family, hf_dir in checkpoints.items()}
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(outcome, handle)
    shutdown()


def test_every_checkpoint_loads_into_every_layer_spec_at_tp2(tiny_checkpoint, tiny_qwen3_checkpoint, tmp_path):
    out = tmp_path / "outcome.json"
    checkpoints = {"qwen2": str(tiny_checkpoint), "qwen3": str(tiny_qwen3_checkpoint)}
    mp.spawn(_spec_worker, args=(2, free_port(), checkpoints, str(tmp_path), str(out)), nprocs=2, join=True)
    outcome = json.loads(out.read_text())
    # what TransformerEngine's spec asks for beyond the local spec: nothing for Qwen2 (the local linears keep an empty
    # extra state under TE's keys), the q/k RMSNorm's extra state for Qwen3
    assert outcome["qwen2"]["te_spec_adds"] == []
    assert outcome["qwen3"]["te_spec_adds"] == [
        "self_attention.k_layernorm._extra_state",
        "self_attention.q_layernorm._extra_state",
    ]
    for family in ("qwen2", "qwen3"):
        results = outcome[family]
        # a tensor the checkpoint lacks is no extra state: the load fails and names it
        assert "holds no decoder.final_layernorm.weight" in results.pop("missing_weight")
        results.pop("te_spec_adds")
        assert set(results) >= {"local_into_te", "te_into_local", "no_extra_state_into_local", "no_extra_state_into_te"}
        assert results == dict.fromkeys(results, True), (family, results)
