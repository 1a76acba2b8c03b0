"""Megatron-core GPTModel on CPU (gloo) against Hugging Face Qwen2 and Qwen3: same logits at TP=1 and TP=2."""

import pytest
import torch
import torch.multiprocessing as mp

from slime_search.utils.net import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _parity_worker(rank: int, world_size: int, port: int, checkpoint: str, ids: torch.Tensor, out_path: str) -> None:
    from transformers import AutoModelForCausalLM

    from megatron_bridge import ModelShape
    from slime_search.backends.megatron import cpu_compat
    from slime_search.backends.megatron.distributed import gather_vocab_parallel, init_megatron, shutdown
    from slime_search.backends.megatron.model import ModelOptions, build_gpt_model, load_hf_weights

    init_megatron(rank, world_size, tp_size=world_size, master_port=port)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    shape, options = ModelShape.from_hf_config(hf.config), ModelOptions.from_hf_config(hf.config)
    model = build_gpt_model(shape, options).eval()
    load_hf_weights(model, hf.state_dict(), shape, options)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        logits = model(ids, positions, attention_mask=cpu_compat.causal_mask(ids.shape[1]))
    full = gather_vocab_parallel(logits)[..., : shape.vocab_size]
    if rank == 0:
        torch.save(full, out_path)
    shutdown()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_logits_match_hf(request, tmp_path, tp, family):
    from transformers import AutoModelForCausalLM

    tiny_checkpoint = request.getfixturevalue("tiny_checkpoint" if family == "qwen2" else "tiny_qwen3_checkpoint")

    ids = torch.randint(0, 151_000, (2, 24), generator=torch.Generator().manual_seed(tp))
    out = tmp_path / "logits.pt"
    mp.spawn(_parity_worker, args=(tp, free_port(), str(tiny_checkpoint), ids, str(out)), nprocs=tp, join=True)
    megatron_logits = torch.load(out)
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = hf(ids).logits
    assert megatron_logits.shape == hf_logits.shape
    # float32 on CPU; TP=2 sums partial products in a different order, hence a tolerance rather than equality
    assert (megatron_logits - hf_logits).abs().max().item() < 1e-4


@pytest.mark.gpu
def test_transformer_engine_spec_in_bf16_matches_hf_on_gpu(tiny_checkpoint, tmp_path):
    import importlib.util

    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("needs a CUDA GPU with TransformerEngine (pip install -e '.[gpu]')")
    from transformers import AutoModelForCausalLM

    from megatron_bridge import ModelShape
    from slime_search.backends.megatron.distributed import init_megatron, shutdown
    from slime_search.backends.megatron.model import ModelOptions, build_gpt_model, load_hf_weights, uses_te_names

    init_megatron(0, 1, tp_size=1, master_port=free_port())
    try:
        hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16).cuda().eval()
        shape = ModelShape.from_hf_config(hf.config)
        options = ModelOptions.from_hf_config(hf.config, params_dtype=torch.bfloat16)
        model = build_gpt_model(shape, options).cuda().eval()
        assert uses_te_names(model)
        load_hf_weights(model, {k: v.float() for k, v in hf.state_dict().items()}, shape, options)
        ids = torch.randint(0, 151_000, (1, 64), device="cuda")
        with torch.no_grad():
            ours = model(ids, torch.arange(64, device="cuda")[None], attention_mask=None)[..., : shape.vocab_size]
            reference = hf(ids).logits
        assert (ours.float() - reference.float()).abs().max().item() < 5e-2  # bf16
    finally:
        shutdown()
