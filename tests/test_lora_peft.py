"""PEFT's adapter folder both ways (backends/megatron/lora_peft.py): the folder this project writes reads back to the
same fused adapters, and a folder that does not fit the flags (--lora-adapter-path) is refused at start-up, naming
what differs. Loading a PEFT-saved folder onto the Megatron actor at TP 1 and TP 2 is checked against PEFT's logits in
tests/backends/test_megatron_lora.py."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_bridge import ModelShape
from slime_search.arguments import parse_args
from slime_search.backends.megatron.lora_peft import (
    megatron_adapters_from_peft,
    read_peft_adapters,
    save_peft_adapter,
)
from slime_search.config.lora import LoraConfig
from slime_search.health.config import health_config
from slime_search.run.config import model_source
from tests.test_lora_flags import BASE

RANK, ALPHA = 4, 8.0
CONFIG = LoraConfig(lora_rank=RANK, lora_alpha=ALPHA)
MODULES = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp", "linear_fc2": "mlp"}


@pytest.fixture(scope="module")
def shape(tiny_checkpoint) -> ModelShape:
    from transformers import AutoConfig

    return ModelShape.from_hf_config(AutoConfig.from_pretrained(tiny_checkpoint))


def random_adapters(shape: ModelShape, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Megatron-form adapters, full size: {module path: (A [r, in], B [out, r])}."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    sizes = {
        "linear_qkv": (shape.hidden_size, qkv),
        "linear_proj": (shape.num_heads * shape.head_dim, shape.hidden_size),
        "linear_fc1": (shape.hidden_size, 2 * shape.ffn_hidden_size),
        "linear_fc2": (shape.ffn_hidden_size, shape.hidden_size),
    }
    return {
        f"decoder.layers.{i}.{MODULES[p]}.{p}": (torch.randn(RANK, n_in, generator=gen), torch.randn(n_out, RANK, generator=gen))
        for i in range(shape.num_layers)
        for p, (n_in, n_out) in sizes.items()
    }  # fmt: skip


def saved_folder(tmp_path, shape, config=CONFIG):
    folder = tmp_path / "adapter"
    save_peft_adapter(folder, random_adapters(shape), shape, config, "base")
    return folder


def test_the_folder_this_project_writes_reads_back_to_the_same_fused_adapters(tmp_path, shape):
    adapters = random_adapters(shape)
    save_peft_adapter(tmp_path / "adapter", adapters, shape, CONFIG, "base")
    back = megatron_adapters_from_peft(read_peft_adapters(tmp_path / "adapter", CONFIG), shape)
    assert set(back) == set(adapters) and len(back) == 4 * shape.num_layers
    for path, (a, b) in adapters.items():
        assert torch.equal(back[path][0], a) and torch.equal(back[path][1], b), path


def test_a_folder_peft_trained_with_an_a_per_projection_is_refused(tmp_path, tiny_checkpoint):
    """PEFT's own initialisation draws a separate A for q, k and v: Megatron's fused linear_qkv takes one."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    peft = PeftLoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear")
    get_peft_model(hf, peft).save_pretrained(tmp_path / "peft")
    with pytest.raises(ValueError, match=r"q_proj, k_proj, v_proj adapters have A's of their own.*linear_qkv"):
        read_peft_adapters(tmp_path / "peft", CONFIG)


def edited_config(folder, **changes) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"r": 8}, r"--lora-rank 4 but the folder's r is 8"),
        ({"lora_alpha": 16}, r"--lora-alpha 8 but the folder's lora_alpha is 16"),
        ({"use_dora": True}, r"no DoRA"),
    ],
)
def test_a_folder_whose_settings_differ_from_the_flags_is_refused(tmp_path, shape, change, message):
    folder = saved_folder(tmp_path, shape)
    edited_config(folder, **change)
    with pytest.raises(ValueError, match=message):
        read_peft_adapters(folder, CONFIG)


def test_a_folder_with_adapters_beyond_the_targets_or_short_of_them_is_refused(tmp_path, shape):
    folder = saved_folder(tmp_path, shape)
    attention_only = LoraConfig(lora_rank=RANK, lora_alpha=ALPHA, target_modules="q_proj,k_proj,v_proj,o_proj")
    with pytest.raises(ValueError, match=r"adapters on linear_fc1, linear_fc2, which --target-modules"):
        read_peft_adapters(folder, attention_only)
    weights = folder / "adapter_model.safetensors"
    state = load_file(str(weights))
    del state["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"]
    save_file(state, str(weights))
    with pytest.raises(ValueError, match=r"layer 1 has no up_proj.lora_B"):
        read_peft_adapters(folder, CONFIG)


def test_the_flag_reaches_the_model_source_and_a_folder_that_does_not_fit_is_a_usage_error(tmp_path, shape, capsys):
    folder = saved_folder(tmp_path, shape)
    lora = ["--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--lora-adapter-path", str(folder)]
    args = parse_args([*BASE, *lora])
    assert model_source(args).lora.lora_adapter_path == str(folder)
    # B does not start at zero: the gradient-spike bound needs no warm-up window
    assert not health_config(args).adapters_from_zero
    assert health_config(parse_args([*BASE, "--lora-rank", "4"])).adapters_from_zero
    refused = {
        "needs --lora-rank": ["--lora-adapter-path", str(folder)],
        "--lora-rank 8 but the folder's r is 4": ["--lora-rank", "8", "--lora-adapter-path", str(folder)],
        "holds adapter_config.json and adapter_model.safetensors": [*lora[:4], "--lora-adapter-path", str(tmp_path)],
    }
    for message, flags in refused.items():
        with pytest.raises(SystemExit) as stopped:
            parse_args([*BASE, *flags])
        assert stopped.value.code == 2 and message in capsys.readouterr().err, message
