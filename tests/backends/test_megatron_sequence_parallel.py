"""Sequence parallelism (--sequence-parallel, as the 3B recipe runs it at TP 2) on Megatron's local spec, without
TransformerEngine: the packed attention's and Megatron's own local attention.

Models built with ModelOptions(sequence_parallel=True) at TP 2 over gloo, against the same HF weights at TP 1, on one
packed row (four samples and a padding segment): logits, log-probs and every gradient (gathered to full shapes), then
three GRPO steps (their losses and gradient norms, the weights after them). Each TP rank normalises only its half of the
row, so its gradients of the norms are partial until finalize_model_grads sums those marked sequence-parallel: were one
left unmarked, its TP 2 gradient would be one rank's tokens' share of TP 1's and its replicas would drift apart. Also: which norms are
marked (not the q/k norms, which act on heads after the sequence is gathered), the checkpoint keys are those of
Megatron's own local spec, and `auto` takes the packed attention where TransformerEngine is found but does not import.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from megatron_bridge import ModelShape, gather_tensor_parallel, megatron_to_hf_part
from slime_search.utils.net import free_port
from tests.backends.test_megatron_train import fixed_batch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
# the recipe's family with both local-spec attentions; Qwen3 (its q/k norms are the same whatever the attention) with the
# packed one only, to keep the test short
ATTENTIONS = {"qwen2": ("packed", "local"), "qwen3": ("packed",)}
REPO_ROOT = Path(__file__).resolve().parents[2]


def _checkpoint_keys(model) -> dict:
    """What a torch_dist checkpoint stores for each tensor of the model: its key and kind, and for a plain sharded
    tensor its global shape, offset and replica id (a factory, as of the fused gate/up weight, builds its own)."""
    out = {}
    for name, item in model.sharded_state_dict().items():
        where = (
            (tuple(item.global_shape), tuple(item.global_offset), item.replica_id)
            if hasattr(item, "global_shape")
            else ()
        )
        out[name] = (item.key, type(item).__name__, *where)
    return out


def _megatrons_own_local_spec_keys(shape, hf_config) -> dict:
    """The checkpoint keys of a model built from Megatron's local spec as it is (WrappedTorchNorm; no sequence
    parallelism, which that spec refuses)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from slime_search.backends.megatron import model as model_module

    own = model_module.local_block_spec
    model_module.local_block_spec = lambda config, qk_norm, packed_attention: get_gpt_layer_local_spec(
        qk_layernorm=qk_norm, normalization="RMSNorm"
    )
    try:
        options = model_module.ModelOptions.from_hf_config(hf_config, attention_impl="local")
        return _checkpoint_keys(model_module.build_gpt_model(shape, options))
    finally:
        model_module.local_block_spec = own


def _trained(model, shape: ModelShape) -> dict:
    """One packed row through the model (its gradients reduced as a training step reduces them: DDP, then
    finalize_model_grads), then the actor end to end: old log-probs, three GRPO steps over micro-batches of at most 24
    tokens (each padded to the TP size under sequence parallelism), the weights after them."""
    from slime_search.backends.megatron.actor import ActorConfig, MegatronActor, _forward
    from slime_search.backends.megatron.distributed import gather_vocab_parallel
    from slime_search.backends.megatron.logprobs import token_log_probs
    from slime_search.backends.megatron.loss import LossConfig, response_logits_and_targets
    from slime_search.backends.megatron.optimizer import OptimConfig
    from slime_search.backends.megatron.packing import pack

    config = ActorConfig(
        loss=LossConfig(vocab_size=shape.vocab_size),
        optim=OptimConfig(lr=1e-4),
        max_tokens_per_micro_batch=24,
        probe_tokens=0,  # the policy-shift probe is one more forward per step, and not what is compared here
    )
    actor = MegatronActor(model, config)
    out = {
        "sequence_parallel": model.config.sequence_parallel,
        "multiple": actor.layout.multiple,
        "marked": sorted(n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)),
        "replicated": sorted(n for n, p in model.named_parameters() if not getattr(p, "tensor_model_parallel", False)),
        "checkpoint_keys": _checkpoint_keys(model),
    }
    samples = fixed_batch()
    packed = pack([s.tokens for s in samples], [s.response_length for s in samples], multiple=16)
    actor.model.zero_grad_buffer()
    logits = _forward(actor.model, packed, actor.layout)
    rows, targets = response_logits_and_targets(logits, packed)
    log_probs = token_log_probs(rows, targets, 1.0, shape.vocab_size)
    weights = torch.linspace(-1.0, 1.0, log_probs.numel())  # signs differ so no gradient cancels by symmetry
    (log_probs * weights).sum().backward()
    actor._finalize_grads()
    out["logits"] = gather_vocab_parallel(logits.detach())[..., : shape.vocab_size]
    out["log_probs"] = log_probs.detach()
    out["grads"] = {name: p.main_grad.detach().clone() for name, p in model.named_parameters()}
    for sample, lp in zip(samples, actor.compute_log_probs(samples), strict=True):
        sample.old_log_probs = lp
    out["old"] = [s.old_log_probs for s in samples]
    out["steps"] = [
        {k: v for k, v in actor.train_step(samples).items() if k in ("loss", "grad_norm")} for _ in range(3)
    ]
    out["weights"] = actor.local_state_dict()
    return out


def _worker(rank: int, world: int, port: int, checkpoints: dict[str, str], out_path: str) -> None:
    """At TP `world` (sequence parallelism on when it is 2): every family's checkpoint with each attention."""
    from transformers import AutoModelForCausalLM

    from slime_search.backends.megatron.distributed import init_megatron, shutdown
    from slime_search.backends.megatron.model import ModelOptions, build_gpt_model, load_hf_weights

    init_megatron(rank, world, tp_size=world, master_port=port)
    for family, checkpoint in checkpoints.items():
        hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        shape = ModelShape.from_hf_config(hf.config)
        for impl in ATTENTIONS[family]:
            options = ModelOptions.from_hf_config(hf.config, attention_impl=impl, sequence_parallel=world > 1)
            model = build_gpt_model(shape, options)
            load_hf_weights(model, hf.state_dict(), shape, options)
            torch.save(_trained(model, shape), f"{out_path}.{family}.{impl}.{rank}.pt")
        if world > 1:
            keys = _megatrons_own_local_spec_keys(shape, hf.config)
            torch.save(keys, f"{out_path}.{family}.megatron_keys.{rank}.pt")
    shutdown()


def _run(world: int, checkpoints: dict[str, str], tmp_path) -> str:
    out = str(tmp_path / f"tp{world}")
    mp.spawn(_worker, args=(world, free_port(), checkpoints, out), nprocs=world, join=True)
    return out


def _full(ranks: list[dict], key: str, shape: ModelShape) -> dict[str, torch.Tensor]:
    """Every rank's shard of `key` (weights or gradients) gathered to full HF-named tensors, vocabulary padding off."""
    return megatron_to_hf_part(gather_tensor_parallel([r[key] for r in ranks]), shape)


def _assert_close(ours: dict, theirs: dict, tolerance: float, what: str) -> None:
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].shape == tensor.shape, (what, name)
        assert (ours[name] - tensor).abs().max().item() < tolerance, (what, name)


def test_sequence_parallel_at_tp2_matches_tp1_without_transformer_engine(
    tiny_checkpoint, tiny_qwen3_checkpoint, tmp_path
):
    """Qwen2 (the recipe's Qwen2.5: q/k/v biases, tied embeddings) and Qwen3 (q/k norms)."""
    from transformers import AutoConfig

    checkpoints = {"qwen2": str(tiny_checkpoint), "qwen3": str(tiny_qwen3_checkpoint)}
    tp1, tp2 = _run(1, checkpoints, tmp_path), _run(2, checkpoints, tmp_path)
    for family, checkpoint in checkpoints.items():
        shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(checkpoint))
        megatron_keys = torch.load(f"{tp2}.{family}.megatron_keys.0.pt")
        sequence_sharded = {"decoder.final_layernorm.weight"} | {
            f"decoder.layers.{i}.{norm}.weight"
            for i in range(shape.num_layers)
            for norm in ("input_layernorm", "pre_mlp_layernorm")
        }
        for impl in ATTENTIONS[family]:
            what = f"{family} {impl}"
            single = torch.load(f"{tp1}.{family}.{impl}.0.pt")
            pair = [torch.load(f"{tp2}.{family}.{impl}.{rank}.pt") for rank in range(2)]
            assert not single["sequence_parallel"] and single["marked"] == [] and single["multiple"] == 1
            # the norms on sequence-sharded activations, and only they, are marked for finalize_model_grads
            assert all(r["sequence_parallel"] and r["multiple"] == 2 for r in pair), what
            assert pair[0]["marked"] == sorted(sequence_sharded), what
            # a torch_dist checkpoint of it has the keys, shapes and offsets of Megatron's own local spec
            assert pair[0]["checkpoint_keys"] == megatron_keys, what

            assert (pair[0]["logits"] - single["logits"]).abs().max().item() < 1e-5, what
            assert (pair[0]["log_probs"] - single["log_probs"]).abs().max().item() < 1e-5, what
            grads = _full(pair, "grads", shape)
            _assert_close(grads, _full([single], "grads", shape), 1e-5, f"{what} gradient")
            # every parameter got a gradient to compare
            assert all(g.abs().max().item() > 0 for g in grads.values()), what
            for name in pair[0]["replicated"]:  # the replicas are reduced to the same gradient on both ranks
                assert torch.equal(pair[0]["grads"][name], pair[1]["grads"][name]), (what, name)

            for ours, theirs in zip(pair[0]["old"], single["old"], strict=True):
                assert ours == pytest.approx(theirs, abs=1e-5), what
            for ours, theirs in zip(pair[0]["steps"], single["steps"], strict=True):
                assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7), what
            # Adam makes every update about lr (1e-4) in size, even where the gradient is rounding noise (the k bias:
            # softmax ignores a shift of every key, so its exact gradient is 0): the weights agree to a tenth of lr
            _assert_close(_full(pair, "weights", shape), _full([single], "weights", shape), 1e-5, f"{what} weights")
            for name in pair[0]["replicated"]:
                assert torch.equal(pair[0]["weights"][name], pair[1]["weights"][name]), (what, name)
            moved = _full([single], "weights", shape)["model.norm.weight"] - 1.0
            assert moved.abs().max().item() > 1e-5, what  # the steps moved the policy, the norms included


def test_auto_takes_the_packed_attention_where_transformer_engine_is_found_but_does_not_import(tmp_path):
    """A TransformerEngine whose extension does not load for this torch: Python finds the package, its import fails,
    and Megatron builds without it; `auto` must not pick TransformerEngine's spec then. CUDA is faked present."""
    package = tmp_path / "transformer_engine"
    package.mkdir()
    (package / "__init__.py").write_text("import transformer_engine_torch  # not built for this torch\n")
    script = (
        "import importlib.util, torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "from slime_search.backends.megatron.model import resolve_attention_impl, te_available\n"
        "print(importlib.util.find_spec('transformer_engine') is not None, te_available(), "
        "resolve_attention_impl('auto'))\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False", "packed"]
