"""LoRA on the Megatron actor (backends/megatron/lora.py) against PEFT on the HF model, at TP 1 and at TP 2 with
sequence parallelism (the 3B recipe's layout), on the tiny Qwen2 and Qwen3.

The same adapters are set on both sides: PEFT's q/k/v adapters share the fused linear_qkv's A (its B's rows split by
Megatron's group interleaving), gate/up share linear_fc1's. The Megatron side reads them from the folder PEFT saved
(`lora_peft.load_peft_adapters`, what --lora-adapter-path does), each rank its shard. Compared: the logits, every adapter gradient (PEFT's
shared-A gradients summed), the weights with the adapters folded in (PEFT's merge_and_unload), the logits with the
adapters disabled (the base model's: the KL reference), and which parameters train (only the adapters')."""

import pytest
import torch
import torch.multiprocessing as mp

from megatron_bridge import ModelShape, gather_tensor_parallel, megatron_to_hf_part
from megatron_bridge.qwen import fuse_qkv
from slime_search.utils.net import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RANK, ALPHA = 4, 8.0
HF_NAMES = {  # Megatron's projection -> the HF projections it fuses
    "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attention.linear_proj": ("self_attn.o_proj",),
    "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.linear_fc2": ("mlp.down_proj",),
}
COLUMN = ("linear_qkv", "linear_fc1")


def hf_adapters(hf_model, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Random adapters for every HF projection, shared A where Megatron fuses: {hf module path: (A, B)}."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(hf_model.config.num_hidden_layers):
        layer = hf_model.model.layers[i]
        for names in HF_NAMES.values():
            first = layer.get_submodule(names[0])
            a = torch.randn(RANK, first.in_features, generator=gen) * 0.2
            for name in names:
                b = torch.randn(layer.get_submodule(name).out_features, RANK, generator=gen) * 0.2
                out[f"model.layers.{i}.{name}"] = (a, b)
    return out


def megatron_adapters(adapters: dict, shape: ModelShape) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The same adapters on Megatron's fused projections, full size: {megatron module path: (A, B)}."""
    out = {}
    for i in range(shape.num_layers):
        for megatron, names in HF_NAMES.items():
            pairs = [adapters[f"model.layers.{i}.{name}"] for name in names]
            b = [pair[1] for pair in pairs]
            fused = fuse_qkv(*b, shape) if megatron.endswith("qkv") else torch.cat(b)
            out[f"decoder.layers.{i}.{megatron}"] = (pairs[0][0], fused)
    return out


def _worker(rank: int, world: int, port: int, checkpoint: str, peft_folder: str, ids, weights, out_path: str) -> None:
    from transformers import AutoModelForCausalLM

    from slime_search.backends.megatron import cpu_compat
    from slime_search.backends.megatron.distributed import gather_vocab_parallel, init_megatron, shutdown
    from slime_search.backends.megatron.lora import LoraConfig, adapters_disabled, apply_lora, merged_state_dict
    from slime_search.backends.megatron.lora_peft import load_peft_adapters
    from slime_search.backends.megatron.model import ModelOptions, build_gpt_model, load_hf_weights

    init_megatron(rank, world, tp_size=world, master_port=port)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    shape = ModelShape.from_hf_config(hf.config)
    options = ModelOptions.from_hf_config(hf.config, attention_impl="packed", sequence_parallel=world > 1)
    model = build_gpt_model(shape, options)
    load_hf_weights(model, hf.state_dict(), shape, options)
    config = LoraConfig(lora_rank=RANK, lora_alpha=ALPHA)
    wrapped = apply_lora(model, config)
    load_peft_adapters(model, peft_folder, config, shape)  # --lora-adapter-path: PEFT's own folder, this rank's shard
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    mask = cpu_compat.causal_mask(ids.shape[1])
    logits = model(ids, positions, attention_mask=mask)
    padded = torch.zeros(*weights.shape[:-1], logits.shape[-1] * world)  # the padding columns weigh nothing
    padded[..., : shape.vocab_size] = weights
    (logits * padded.chunk(world, dim=-1)[rank]).sum().backward()  # each rank its vocabulary shard's part
    with torch.no_grad(), adapters_disabled(model):
        base_logits = model(ids, positions, attention_mask=mask)
    torch.save(
        {
            "wrapped": wrapped,
            "logits": gather_vocab_parallel(logits.detach())[..., : shape.vocab_size],
            "base_logits": gather_vocab_parallel(base_logits)[..., : shape.vocab_size],
            "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
            "with_grad": sorted(n for n, p in model.named_parameters() if p.grad is not None),
            "grads": {path: (m.linear_in.weight.grad, m.linear_out.weight.grad) for path in wrapped
                      for m in [model.get_submodule(path)]},
            "merged": merged_state_dict(model),
        },
        f"{out_path}.{rank}.pt",
    )  # fmt: skip
    shutdown()


def full_grads(ranks: list[dict], shape, tp: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's adapter gradients put back to full size (the inverse of the sharding load_peft_adapters does)."""
    out = {}
    for path in ranks[0]["grads"]:
        a = [r["grads"][path][0] for r in ranks]
        b = [r["grads"][path][1] for r in ranks]
        if path.rsplit(".", 1)[-1] in COLUMN:
            name = f"{path}.weight"
            full_b = gather_tensor_parallel([{name: x} for x in b])[name]
            out[path] = (torch.cat(a, dim=0), full_b)
        else:
            out[path] = (torch.cat(a, dim=1), torch.cat(b, dim=0))
    return out


def peft_reference(checkpoint: str, adapters: dict, ids, weights, folder):
    """PEFT's LoRA on the HF model with the same adapters, saved by PEFT to `folder`: logits, the adapters'
    gradients, the merged weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    targets = sorted({name.rsplit(".", 1)[-1] for names in HF_NAMES.values() for name in names})
    model = get_peft_model(hf, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=targets))
    with torch.no_grad():
        for path, (a, b) in adapters.items():
            module = model.base_model.model.get_submodule(path)
            module.lora_A["default"].weight.copy_(a)
            module.lora_B["default"].weight.copy_(b)
    model.save_pretrained(folder)
    logits = model(ids).logits
    (logits * weights).sum().backward()
    grads = {}
    for path in adapters:
        module = model.base_model.model.get_submodule(path)
        grads[path] = (module.lora_A["default"].weight.grad, module.lora_B["default"].weight.grad)
    merged = model.merge_and_unload().state_dict()
    return logits.detach(), grads, merged


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_lora_at_tp1_and_tp2_with_sequence_parallelism_matches_peft(request, tmp_path, family):
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint = str(request.getfixturevalue("tiny_checkpoint" if family == "qwen2" else "tiny_qwen3_checkpoint"))
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(checkpoint))
    adapters = hf_adapters(hf, seed=3)
    ids = torch.randint(0, shape.vocab_size, (1, 24), generator=torch.Generator().manual_seed(5))
    weights = torch.randn(1, 24, shape.vocab_size, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        base_logits = hf(ids).logits
    folder = str(tmp_path / f"{family}_peft")
    peft_logits, peft_grads, peft_merged = peft_reference(checkpoint, adapters, ids, weights, folder)
    assert (peft_logits - base_logits).abs().max().item() > 1e-2  # the adapters change the model

    for tp in (1, 2):
        out = str(tmp_path / f"{family}_tp{tp}")
        mp.spawn(_worker, args=(tp, free_port(), checkpoint, folder, ids, weights, out), nprocs=tp, join=True)
        ranks = [torch.load(f"{out}.{rank}.pt") for rank in range(tp)]
        what = f"{family} TP {tp}"
        assert len(ranks[0]["wrapped"]) == 4 * shape.num_layers, what
        # only the adapters train, and only they received gradients
        assert all(".linear_in." in n or ".linear_out." in n for n in ranks[0]["trainable"]), what
        assert len(ranks[0]["trainable"]) == 8 * shape.num_layers and ranks[0]["with_grad"] == ranks[0]["trainable"]
        assert (ranks[0]["logits"] - peft_logits).abs().max().item() < 1e-4, what
        assert (ranks[0]["base_logits"] - base_logits).abs().max().item() < 1e-4, what

        grads = full_grads(ranks, shape, tp)
        theirs = megatron_adapters(peft_grads, shape)  # fuses the B gradients as the B were fused
        for path, (grad_a, grad_b) in grads.items():
            i, megatron = path.split(".", 3)[2], path.split(".", 3)[3]
            peft_a = sum(peft_grads[f"model.layers.{i}.{name}"][0] for name in HF_NAMES[megatron])  # A is shared
            scale = peft_a.abs().max().item()
            assert (grad_a - peft_a).abs().max().item() < 1e-4 * max(scale, 1.0), (what, path, "A")
            assert (grad_b - theirs[path][1]).abs().max().item() < 1e-4 * max(scale, 1.0), (what, path, "B")

        merged = megatron_to_hf_part(gather_tensor_parallel([r["merged"] for r in ranks]), shape)
        for name, tensor in merged.items():
            assert (tensor - peft_merged[name]).abs().max().item() < 1e-5, (what, name)


def _resume_worker(rank: int, world: int, port: int, checkpoint: str, out_path: str) -> None:
    """TP 2 with sequence parallelism, LoRA rank 4 with dropout: two steps, a checkpoint, the next step; then a fresh
    actor built as a resumed run builds it (the base from the HF folder, new adapters on it) loads the checkpoint and
    takes that next step again."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from slime_search.backends.megatron.actor import ActorConfig, MegatronActor
    from slime_search.backends.megatron.checkpoint import load_actor, save_actor
    from slime_search.backends.megatron.distributed import init_megatron, shutdown
    from slime_search.backends.megatron.lora import LoraConfig, apply_lora
    from slime_search.backends.megatron.loss import LossConfig
    from slime_search.backends.megatron.model import ModelOptions, build_gpt_model, load_hf_weights
    from slime_search.backends.megatron.optimizer import OptimConfig
    from tests.backends.test_megatron_train import fixed_batch

    init_megatron(rank, world, tp_size=world, master_port=port)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    shape = ModelShape.from_hf_config(hf.config)
    options = ModelOptions.from_hf_config(hf.config, attention_impl="packed", sequence_parallel=True)
    config = ActorConfig(
        loss=LossConfig(eps_clip=0.2, eps_clip_high=0.28, vocab_size=shape.vocab_size),
        optim=OptimConfig(lr=1e-2, clip_grad=1.0),
        max_tokens_per_micro_batch=24,
    )
    lora = LoraConfig(lora_rank=RANK, lora_alpha=ALPHA, lora_dropout=0.1)

    def lora_actor() -> MegatronActor:
        model = build_gpt_model(shape, options)
        load_hf_weights(model, hf.state_dict(), shape, options)
        apply_lora(model, lora)
        return MegatronActor(model, config)

    actor, samples = lora_actor(), fixed_batch()
    for sample, lp in zip(samples, actor.compute_log_probs(samples), strict=True):
        sample.old_log_probs = lp
    actor.train_step(samples)
    actor.train_step(samples)  # B is no longer zero: neither are A's gradient and Adam state
    save_dir = Path(out_path + ".ckpt")
    save_actor(actor, save_dir, iteration=2)
    next_step = actor.train_step(samples)
    resumed = lora_actor()
    load_actor(resumed, save_dir)
    resumed.offload()  # a colocated run hands the memory over before its first rollout: the loaded state too
    resumed.onload()
    again = resumed.train_step(samples)
    named = dict(resumed.model.module.named_parameters())
    outcome = {
        "same_metrics": again == next_step,  # every metric equal, bit for bit
        "differing": [name for name, p in actor.model.module.named_parameters() if not torch.equal(p, named[name])],
        "adapters_moved": bool(next_step["grad_norm"] > 0),
    }
    if rank == 0:
        torch.save(outcome, out_path)
    shutdown()


def test_a_lora_actor_resumes_bit_for_bit_at_tp2_with_sequence_parallelism(tiny_checkpoint, tmp_path):
    """The checkpoint holds the adapters, their Adam state and every random stream the dropout draws from (under
    sequence parallelism Megatron's model-parallel one): a resumed actor's next step equals the uninterrupted one's,
    every metric and every parameter, the frozen base included."""
    out = tmp_path / "resume.pt"
    mp.spawn(_resume_worker, args=(2, free_port(), str(tiny_checkpoint), str(out)), nprocs=2, join=True)
    outcome = torch.load(out)
    assert outcome["adapters_moved"]
    assert outcome["differing"] == [] and outcome["same_metrics"]
