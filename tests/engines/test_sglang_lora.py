"""The PEFT adapter folder this project writes (`save_peft_adapter`: --save-hf's `adapter/`, and
tools/convert_lora_to_hf.py) served by the pinned SGLang on CPU: loaded through /load_lora_adapter, and the same
adapters as tensors in shared memory through /load_lora_adapter_from_tensors (`weight_wire.serialize_named_tensors`),
each asked for by name and answering the log-probs PEFT computes on the HF model with the same adapters."""

import json

import pytest
import requests
import torch
from safetensors.torch import load_file

from megatron_bridge import ModelShape
from slime_search.backends.megatron.lora_peft import save_peft_adapter
from slime_search.config.lora import LoraConfig
from slime_search.engines.weight_wire import serialize_named_tensors
from slime_search.utils.net import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RANK = 8


def random_adapters(shape: ModelShape, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Whole adapters on every Megatron projection, as `full_adapters` returns them: {path: (A [r, in], B [out, r])}."""
    gen = torch.Generator().manual_seed(seed)
    qkv_rows = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    sizes = {  # projection: (in, out)
        "self_attention.linear_qkv": (shape.hidden_size, qkv_rows),
        "self_attention.linear_proj": (shape.num_heads * shape.head_dim, shape.hidden_size),
        "mlp.linear_fc1": (shape.hidden_size, 2 * shape.ffn_hidden_size),
        "mlp.linear_fc2": (shape.ffn_hidden_size, shape.hidden_size),
    }
    return {
        f"decoder.layers.{layer}.{name}": (
            torch.randn(RANK, fan_in, generator=gen) * 0.2,
            torch.randn(fan_out, RANK, generator=gen) * 0.2,
        )
        for layer in range(shape.num_layers)
        for name, (fan_in, fan_out) in sizes.items()
    }


def input_log_probs(url: str, ids: list[int], lora: str | None) -> list[float]:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if lora is not None:
        body["lora_path"] = lora  # SGLang's field: the name an adapter was loaded under
    response = requests.post(f"{url}/generate", json=body, timeout=300)
    assert response.ok, response.text[:500]
    return [entry[0] for entry in response.json()["meta_info"]["input_token_logprobs"][1:]]


def hf_log_probs(model, ids: list[int]) -> list[float]:
    tokens = torch.tensor([ids])
    with torch.no_grad():
        logits = model(tokens).logits.log_softmax(-1)
    return logits[0, :-1].gather(-1, tokens[0, 1:, None])[:, 0].tolist()


def test_sglang_serves_the_peft_folder_as_peft_does(tiny_checkpoint, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests import sglang_cpu

    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    shape = ModelShape.from_hf_config(base.config)
    folder = tmp_path / "adapter"
    config = LoraConfig(lora_rank=RANK, lora_alpha=16.0)
    save_peft_adapter(folder, random_adapters(shape), shape, config, str(tiny_checkpoint))
    ids = list(range(3, 40))
    expected_base = hf_log_probs(base, ids)
    expected = hf_log_probs(PeftModel.from_pretrained(base, folder).eval(), ids)
    assert max(abs(a - b) for a, b in zip(expected, expected_base, strict=True)) > 0.1  # the adapters matter

    port = free_port()
    engine = sglang_cpu.start_engine(tiny_checkpoint, port, log_path=tmp_path / "engine.log", lora_rank=RANK)
    try:
        url = f"http://127.0.0.1:{port}"
        loaded = requests.post(f"{url}/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(folder)})
        assert loaded.ok and loaded.json()["success"], loaded.text[:500]
        tensors = load_file(folder / "adapter_model.safetensors")  # alive until the engine has answered
        pushed = requests.post(
            f"{url}/load_lora_adapter_from_tensors",
            json={
                "lora_name": "pushed",
                "config_dict": json.loads((folder / "adapter_config.json").read_text()),
                "serialized_named_tensors": [serialize_named_tensors(tensors)],  # one entry per engine TP rank
            },
        )
        assert pushed.ok and pushed.json()["success"], pushed.text[:500]
        answers = {name: input_log_probs(url, ids, name) for name in ("policy", "pushed", None)}
    finally:
        engine.stop()
    for name in ("policy", "pushed"):
        assert max(abs(a - b) for a, b in zip(answers[name], expected, strict=True)) < 1e-4, name
    assert max(abs(a - b) for a, b in zip(answers[None], expected_base, strict=True)) < 1e-4
