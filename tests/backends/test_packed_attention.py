"""PackedAttention (--attention-impl packed): Megatron's local spec attending within each packed sample only.

Against Megatron's own local attention over the packed row's block-diagonal mask, on CPU in fp32: the same logits,
log-probs and gradients, and the same GRPO steps; attention computed sample by sample, never over the whole row; the
flag's choices and the default without TransformerEngine.
"""

import json

import pytest
import torch
import torch.multiprocessing as mp

from slime_search.utils.net import free_port
from tests.backends.test_megatron_train import fixed_batch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _forward_and_backward(model, packed, layout):
    """Logits of the packed row, response log-probs, and every parameter's gradient of a weighted log-prob sum."""
    from slime_search.backends.megatron.actor import _forward
    from slime_search.backends.megatron.logprobs import token_log_probs
    from slime_search.backends.megatron.loss import response_logits_and_targets

    model.zero_grad()
    logits = _forward(model, packed, layout)
    rows, targets = response_logits_and_targets(logits, packed)
    log_probs = token_log_probs(rows, targets, 1.0, 151_936)
    weights = torch.linspace(-1.0, 1.0, log_probs.numel())  # signs differ so no gradient cancels by symmetry
    (log_probs * weights).sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return logits.detach(), log_probs.detach(), grads


def _worker(rank, world, port, checkpoint, out_path):
    from transformers import AutoModelForCausalLM

    from megatron_bridge import ModelShape
    from slime_search.backends.megatron.actor import ActorConfig, Layout, MegatronActor
    from slime_search.backends.megatron.distributed import init_megatron, shutdown
    from slime_search.backends.megatron.loss import LossConfig
    from slime_search.backends.megatron.model import ModelOptions, build_gpt_model, load_hf_weights
    from slime_search.backends.megatron.optimizer import OptimConfig
    from slime_search.backends.megatron.packing import pack

    init_megatron(rank, world, tp_size=world, master_port=port)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    shape = ModelShape.from_hf_config(hf.config)
    samples = fixed_batch()
    # the four samples and a padding segment of 4 (44 tokens to a multiple of 16): five segments in one row
    packed = pack([s.tokens for s in samples], [s.response_length for s in samples], multiple=16)
    config = ActorConfig(
        loss=LossConfig(vocab_size=shape.vocab_size), optim=OptimConfig(lr=1e-4), max_tokens_per_micro_batch=24
    )
    out = {}
    for impl in ("local", "packed"):
        options = ModelOptions.from_hf_config(hf.config, attention_impl=impl)
        model = build_gpt_model(shape, options)
        load_hf_weights(model, hf.state_dict(), shape, options)
        layout = Layout.of(model)
        logits, log_probs, grads = _forward_and_backward(model, packed, layout)
        torch.save({"logits": logits, "log_probs": log_probs, "grads": grads}, f"{out_path}.{impl}.pt")
        actor = MegatronActor(model, config)
        batch = fixed_batch()
        for sample, lp in zip(batch, actor.compute_log_probs(batch), strict=True):
            sample.old_log_probs = lp
        out[impl] = {
            "thd": layout.thd,
            "core_attention": type(model.decoder.layers[0].self_attention.core_attention).__name__,
            "old": [s.old_log_probs for s in batch],
            "steps": [
                {k: v for k, v in actor.train_step(batch).items() if k in ("loss", "grad_norm")} for _ in range(3)
            ],
            "after": actor.compute_log_probs(batch),
        }
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(out, handle)
    shutdown()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_packed_attention_matches_the_local_spec_in_fp32(request, tmp_path, family):
    """Qwen2 (4 heads over 2 key/value groups, q/k/v biases) and Qwen3 (q/k norms, head size 32 != 64 / 4)."""
    checkpoint = request.getfixturevalue("tiny_checkpoint" if family == "qwen2" else "tiny_qwen3_checkpoint")
    out = tmp_path / "packed.json"
    mp.spawn(_worker, args=(1, free_port(), str(checkpoint), str(out)), nprocs=1, join=True)
    results = json.loads(out.read_text())
    assert results["local"]["core_attention"] == "DotProductAttention" and not results["local"]["thd"]
    assert results["packed"]["core_attention"] == "PackedAttention" and results["packed"]["thd"]

    local, packed = (torch.load(f"{out}.{impl}.pt") for impl in ("local", "packed"))
    assert (packed["logits"] - local["logits"]).abs().max().item() < 1e-5
    assert (packed["log_probs"] - local["log_probs"]).abs().max().item() < 1e-5
    assert local["grads"].keys() == packed["grads"].keys()
    for name, grad in local["grads"].items():
        assert grad.abs().max().item() > 0, name  # every parameter got a gradient to compare
        assert (packed["grads"][name] - grad).abs().max().item() < 1e-5, name

    # the actor end to end: old log-probs, three GRPO steps, log-probs after them
    for ours, theirs in zip(results["packed"]["old"], results["local"]["old"], strict=True):
        assert ours == pytest.approx(theirs, abs=1e-5)
    for ours, theirs in zip(results["packed"]["steps"], results["local"]["steps"], strict=True):
        assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7)
    for ours, theirs in zip(results["packed"]["after"], results["local"]["after"], strict=True):
        assert ours == pytest.approx(theirs, abs=1e-5)
    steps = results["local"]["steps"]
    assert steps[0]["grad_norm"] > 0 and steps[2]["loss"] != steps[0]["loss"]  # the steps moved the policy


def _attention(heads=4, groups=2, head_dim=8):
    from types import SimpleNamespace

    from slime_search.backends.megatron.packed_attention import PackedAttention

    config = SimpleNamespace(
        context_parallel_size=1, window_size=None, softmax_type="vanilla", kv_channels=head_dim, attention_dropout=0.0
    )
    # MegatronModule's constructor only keeps the config
    return PackedAttention(config, layer_number=1, attn_mask_type=None, attention_type="self")


def test_each_sample_attends_alone_and_never_over_the_whole_row(monkeypatch):
    """The scores are computed per sample (keys of one sample each time), so memory grows with the samples, not with
    the square of the row; and a sample's output does not change when another sample's tokens do."""
    import torch.nn.functional as F
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = [5, 11, 3, 9]
    cu = torch.tensor([0, 5, 16, 19, 28], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=11, max_seqlen_kv=11)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(28, 4, 8, generator=gen),
        torch.randn(28, 2, 8, generator=gen),
        torch.randn(28, 2, 8, generator=gen),
    )
    attention = _attention()

    key_lengths = []
    real = F.scaled_dot_product_attention

    def recording(query, key, *args, **kwargs):
        key_lengths.append(key.shape[-2])
        return real(query, key, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    out = attention(q, k, v, None, packed_seq_params=params)
    assert out.shape == (28, 32)
    assert key_lengths == lengths

    # by hand: causal softmax attention of each sample alone, each query head reading its group's keys (heads 0-1:
    # group 0, heads 2-3: group 1), scale 1/sqrt(8)
    expected = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        n = end - start
        qs, ks, vs = q[start:end], k[start:end].repeat_interleave(2, dim=1), v[start:end].repeat_interleave(2, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) / 8**0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        expected.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs).reshape(n, 32))
    assert (out - torch.cat(expected)).abs().max().item() < 1e-6

    changed = k.clone()
    changed[5:16] += 1.0  # the second sample's keys
    again = attention(q, changed, v, None, packed_seq_params=params)
    untouched = torch.cat([torch.arange(0, 5), torch.arange(16, 28)])
    assert torch.equal(again[untouched], out[untouched])
    assert not torch.allclose(again[5:16], out[5:16])


def test_without_packed_sequences_it_honours_the_mask_it_is_given():
    """A caller that builds its own mask ([s, b] layout, True = masked) gets that mask's attention: here causal
    within two halves of the row, as the local attention would give."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(6, 1, 4, 8, generator=gen),
        torch.randn(6, 1, 2, 8, generator=gen),
        torch.randn(6, 1, 2, 8, generator=gen),
    )
    halves = torch.ones(6, 6, dtype=torch.bool).tril()
    halves[3:, :3] = False
    attention = _attention()
    masked = attention(q, k, v, ~halves.view(1, 1, 6, 6))
    assert masked.shape == (6, 1, 32)
    first = attention(q[:3], k[:3], v[:3], None)  # None: causal
    second = attention(q[3:], k[3:], v[3:], None)
    assert (masked - torch.cat([first, second])).abs().max().item() < 1e-6


def test_the_default_is_transformer_engine_where_it_runs_else_the_packed_attention(monkeypatch):
    from slime_search.backends.megatron import model as model_module

    monkeypatch.setattr(model_module, "te_available", lambda: False)
    assert model_module.resolve_attention_impl("auto") == "packed"
    monkeypatch.setattr(model_module, "te_available", lambda: True)
    assert model_module.resolve_attention_impl("auto") == "te"
    assert model_module.resolve_attention_impl("local") == "local"
    with pytest.raises(ValueError, match="auto, te, local, packed"):
        model_module.resolve_attention_impl("flash")


def test_the_flag_reaches_the_model_options():
    from slime_search.backends.megatron.model import ModelOptions
    from slime_search.run.config import model_source
    from tests.test_arguments import parse

    assert model_source(parse()).model_overrides["attention_impl"] == "auto"
    overrides = model_source(parse("--attention-impl", "local")).model_overrides
    assert ModelOptions(**overrides).attention_impl == "local"
