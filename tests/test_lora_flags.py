"""LoRA's flags (miles' names): which projections get adapters, and the combinations refused at start-up."""

import pytest

from slime_search.arguments import parse_args
from slime_search.config.lora import LoraConfig
from slime_search.run_config import model_source

BASE = [
    "--hf-checkpoint", "ckpt", "--save", "run", "--prompt-data", "p.parquet", "--num-rollout", "2",
    "--rollout-batch-size", "4",
]  # fmt: skip
ALL = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@pytest.mark.parametrize(
    ("targets", "excluded", "projections"),
    [
        ("all-linear", None, ALL),
        ("q_proj,k_proj,v_proj,o_proj", None, ("linear_qkv", "linear_proj")),
        ("linear_fc1, linear_fc2", None, ("linear_fc1", "linear_fc2")),
        ("all-linear", "o_proj,down_proj", ("linear_qkv", "linear_fc1")),
        ("all-linear", "nothing_named_so", None),
        ("q_proj,v_proj", None, None),
        ("o_proj", "o_proj", None),
    ],
)
def test_the_target_modules_name_megatrons_projections(targets, excluded, projections):
    config = dict(lora_rank=8, target_modules=targets, exclude_modules=excluded)
    if projections is not None:
        assert LoraConfig(**config).projections == projections
        return
    with pytest.raises(ValueError, match="--target-modules|--exclude-modules"):
        LoraConfig(**config)


def test_a_partial_fused_projection_says_what_is_missing():
    with pytest.raises(ValueError, match=r"q_proj, v_proj without k_proj: Megatron fuses q_proj, k_proj, v_proj"):
        LoraConfig(lora_rank=8, target_modules="q_proj,v_proj")


def test_lora_flags_reach_the_model_source_and_auto_attention_is_the_packed_one():
    source = model_source(parse_args([*BASE, "--lora-rank", "8", "--lora-alpha", "16", "--lora-dropout", "0.1"]))
    assert source.lora == LoraConfig(lora_rank=8, lora_alpha=16.0, lora_dropout=0.1)
    assert source.lora.scale == 2.0 and source.model_overrides["attention_impl"] == "packed"
    assert not model_source(parse_args(BASE)).lora.enabled
    assert model_source(parse_args(BASE)).model_overrides["attention_impl"] == "auto"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora-rank", "3", "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2"], "--lora-rank 3"),
        (["--lora-rank", "8", "--attention-impl", "te"], "--attention-impl packed"),
        (["--lora-rank", "8", "--target-modules", "q_proj"], "--target-modules"),
        (["--lora-dropout", "1"], "--lora-dropout"),
    ],
)
def test_lora_flags_that_cannot_work_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_args([*BASE, *flags])
    assert stopped.value.code == 2 and message in capsys.readouterr().err
