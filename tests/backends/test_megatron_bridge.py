"""HF <-> Megatron weight mapping for Qwen2 and Qwen3: exact round trips, TP sharding, vocab padding, buckets."""

import pytest
import torch

from megatron_bridge import (
    ModelShape,
    gather_tensor_parallel,
    hf_to_megatron,
    iter_buckets,
    megatron_conversion_units,
    megatron_to_hf,
    megatron_to_hf_part,
    pad_vocab_size,
    shard_tensor_parallel,
)
from megatron_bridge.qwen import fuse_qkv, split_qkv

SHAPE = ModelShape(
    num_layers=2,
    hidden_size=16,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=24,
    vocab_size=50,
    tie_word_embeddings=False,
)
# Qwen3: no q/k/v bias, q/k RMSNorm, a head size of its own (8 != 16 / 4, so q_proj is 32 x 16)
QWEN3 = ModelShape(**{**SHAPE.__dict__, "qkv_bias": False, "qk_norm": True, "kv_channels": 8})


def random_hf_state(shape: ModelShape, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    h, hd, kv, f, v = shape.hidden_size, shape.head_dim, shape.num_kv_heads, shape.ffn_hidden_size, shape.vocab_size
    state = {
        "model.embed_tokens.weight": torch.randn(v, h, generator=gen),
        "model.norm.weight": torch.randn(h, generator=gen),
    }
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        q = shape.num_heads * hd
        sizes = {
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv * hd, h),
            "self_attn.v_proj.weight": (kv * hd, h),
            "self_attn.o_proj.weight": (h, q),
            "mlp.gate_proj.weight": (f, h),
            "mlp.up_proj.weight": (f, h),
            "mlp.down_proj.weight": (h, f),
        }
        if shape.qkv_bias:
            sizes |= {
                "self_attn.q_proj.bias": (q,),
                "self_attn.k_proj.bias": (kv * hd,),
                "self_attn.v_proj.bias": (kv * hd,),
            }
        if shape.qk_norm:
            sizes |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
        state.update({p + k: torch.randn(*s, generator=gen) for k, s in sizes.items()})
    state["lm_head.weight"] = (
        state["model.embed_tokens.weight"] if shape.tie_word_embeddings else torch.randn(v, h, generator=gen)
    )
    return state


def test_qkv_interleaving_by_query_group():
    # 4 heads in 2 groups, head_dim 1: q rows [q0 q1 q2 q3], k [k0 k1], v [v0 v1]
    # -> group 0: q0 q1 k0 v0, group 1: q2 q3 k1 v1
    shape = ModelShape(1, 4, 4, 2, 4, 8, True)
    q, k, v = torch.tensor([0.0, 1, 2, 3]), torch.tensor([10.0, 11]), torch.tensor([20.0, 21])
    fused = fuse_qkv(q, k, v, shape)
    assert fused.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert [t.tolist() for t in split_qkv(fused, shape)] == [q.tolist(), k.tolist(), v.tolist()]


@pytest.mark.parametrize("base", [SHAPE, QWEN3], ids=["qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("te_names", [False, True])
def test_round_trip_is_bit_exact(base, tied, te_names):
    shape = ModelShape(**{**base.__dict__, "tie_word_embeddings": tied})
    hf = random_hf_state(shape)
    padded = pad_vocab_size(shape.vocab_size, 16, 2)  # 50 -> 64
    mg = hf_to_megatron(hf, shape, padded, te_names=te_names)
    assert mg["embedding.word_embeddings.weight"].shape == (64, 16)
    assert torch.all(mg["embedding.word_embeddings.weight"][50:] == 0)
    assert ("output_layer.weight" in mg) is not tied
    assert any("layer_norm_weight" in k for k in mg) is te_names
    assert ("decoder.layers.1.self_attention.q_layernorm.weight" in mg) is shape.qk_norm
    assert ("decoder.layers.1.self_attention.linear_qkv.bias" in mg) is shape.qkv_bias
    back = megatron_to_hf(mg, shape, te_names=te_names)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_qwen3_tensor_parallel_shards_keep_the_qk_norms_whole():
    mg = hf_to_megatron(random_hf_state(QWEN3), QWEN3, pad_vocab_size(50, 16, 2))
    shards = [shard_tensor_parallel(mg, QWEN3, 2, r) for r in range(2)]
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert mg[qkv].shape == ((4 + 2 * 2) * 8, 16) and shards[1][qkv].shape == (32, 16)  # one group: 2 q, k, v
    norm = "decoder.layers.0.self_attention.k_layernorm.weight"
    assert all(torch.equal(shard[norm], mg[norm]) for shard in shards)  # per-head weights: every rank the same
    gathered = gather_tensor_parallel(shards)
    assert all(torch.equal(gathered[k], mg[k]) for k in mg)


@pytest.mark.parametrize("tp", [2])
def test_tensor_parallel_shards_gather_back_exactly(tp):
    mg = hf_to_megatron(random_hf_state(SHAPE), SHAPE, pad_vocab_size(50, 16, tp))
    shards = [shard_tensor_parallel(mg, SHAPE, tp, r) for r in range(tp)]
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert shards[0][qkv].shape[0] == mg[qkv].shape[0] // tp  # one query group per rank
    fc1 = shards[1]["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = torch.chunk(mg["decoder.layers.0.mlp.linear_fc1.weight"], 2)
    assert torch.equal(fc1, torch.cat([gate[12:], up[12:]]))  # each rank holds its half of gate and of up
    assert shards[0]["decoder.layers.0.mlp.linear_fc2.weight"].shape == (16, 12)
    gathered = gather_tensor_parallel(shards)
    assert all(torch.equal(gathered[k], mg[k]) for k in mg)
    with pytest.raises(ValueError, match="must divide"):
        shard_tensor_parallel(mg, SHAPE, 3, 0)


@pytest.mark.parametrize("base", [SHAPE, QWEN3], ids=["qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("te_names", [False, True])
def test_unit_by_unit_conversion_equals_whole_model(base, tied, te_names):
    shape = ModelShape(**{**base.__dict__, "tie_word_embeddings": tied})
    mg = hf_to_megatron(random_hf_state(shape), shape, 64, te_names=te_names)
    units = megatron_conversion_units(mg)
    assert sorted(n for unit in units for n in unit) == sorted(mg)
    assert len(units) == shape.num_layers + 2  # embedding, each layer, final norm (+ output layer)
    assert all(n.startswith(f"decoder.layers.{i}.") for i, unit in enumerate(units[1:-1]) for n in unit)
    streamed = [
        item for unit in units for item in megatron_to_hf_part({n: mg[n] for n in unit}, shape, te_names).items()
    ]
    whole = megatron_to_hf(mg, shape, te_names=te_names)
    if tied:
        whole.pop("lm_head.weight")  # the engines tie it themselves
    assert [n for n, _ in streamed] == list(whole)  # same names, same order
    assert all(torch.equal(t, whole[n]) for n, t in streamed)


def test_buckets_keep_order_and_size_and_draw_lazily():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5])]  # 40, 40, 120, 20, 20 bytes
    buckets = list(iter_buckets(tensors, 80))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    assert [[n for n, _ in b] for b in iter_buckets(tensors, 10_000)] == [["t0", "t1", "t2", "t3", "t4"]]
    assert list(iter_buckets([], 100)) == []
    drawn = []

    def source():
        for name, tensor in tensors:
            drawn.append(name)
            yield name, tensor

    first = next(iter_buckets(source(), 80))
    assert [n for n, _ in first] == ["t0", "t1"] and drawn == ["t0", "t1", "t2"]  # t2 showed the bucket was full
    with pytest.raises(ValueError, match="positive"):
        next(iter_buckets(tensors, 0))


def test_missing_tensor_is_named():
    hf = random_hf_state(SHAPE)
    del hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        hf_to_megatron(hf, SHAPE, 64)
