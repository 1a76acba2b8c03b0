"""LoRA's flags (miles' names): which projections get adapters, and the combinations refused at start-up."""

import pytest

from slime_search.arguments import parse_args
from slime_search.config.lora import LoraConfig
from slime_search.run.config import model_source

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


def test_adapter_sync_reaches_the_engines_the_requests_and_the_transport():
    """--lora-sync-from-tensor: the engines this project starts serve LoRA up to the rank on the adapters'
    projections, every /generate names the served adapter, and the transport is the adapters' own."""
    from slime_search.run.config import run_config

    flags = [*BASE, "--rollout-num-gpus", "1", "--lora-rank", "8", "--target-modules", "q_proj,k_proj,v_proj"]
    config = run_config(parse_args([*flags, "--lora-sync-from-tensor"]), vocab_size=100, use_gpu=False)
    assert config.rollout.served_adapter == config.weight_sync.served_adapter == "policy"
    assert (
        config.weight_sync.lora_rank == 8 and not config.weight_sync.push_base_first
    )  # the engines' base is the actor's
    loaded = run_config(parse_args([*flags, "--lora-sync-from-tensor", "--load", "td"]), vocab_size=100, use_gpu=False)
    assert loaded.weight_sync.push_base_first  # a base from --load goes beneath the adapters once
    assert config.rollout.engines.lora_args == (
        "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "k_proj", "v_proj",
        "--max-loras-per-batch", "1",
    )  # fmt: skip
    plain = run_config(parse_args(flags), vocab_size=100, use_gpu=False)  # each push: the folded weights
    assert plain.rollout.served_adapter is plain.weight_sync.served_adapter is None
    assert plain.rollout.engines.lora_args == ()


def test_the_served_adapter_is_named_by_every_generate_of_the_engine_client():
    from slime_search.engines.client import generate_payload

    assert generate_payload({}, [1, 2], None, True, None, "policy")["lora_path"] == "policy"
    assert "lora_path" not in generate_payload({}, [1, 2], None, True, None)


def test_adapter_sync_where_it_cannot_work_is_a_usage_error_and_colocated_engines_keep_their_base(capsys):
    from slime_search.run.config import run_config

    flags = [*BASE, "--lora-rank", "8", "--lora-sync-from-tensor"]
    with pytest.raises(SystemExit) as stopped:
        parse_args([*flags, "--engine-url", "http://e:1", "--async-mode", "fully"])
    assert stopped.value.code == 2 and "with --async-mode fully" in capsys.readouterr().err
    # colocated: the engines give up only their KV cache while the actor trains (ray.colocation), so the push of the
    # adapters alone finds the base beneath them
    colocated = parse_args([*flags, "--actor-num-gpus-per-node", "2", "--colocate"])
    config = run_config(colocated, vocab_size=100, use_gpu=False)
    assert config.colocate and config.weight_sync.served_adapter == "policy"
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--lora-sync-from-tensor", "--engine-url", "http://e:1"])
    assert "needs --lora-rank" in capsys.readouterr().err


def test_an_engine_that_serves_no_lora_or_too_small_a_rank_is_refused_at_connect():
    from slime_search.weight_sync.lora_adapters import lora_serving_problem

    assert "does not serve LoRA" in lora_serving_problem({"version": "0.5.23", "enable_lora": False}, 8)
    assert "--max-lora-rank 4 is below --lora-rank 8" in lora_serving_problem(
        {"enable_lora": True, "max_lora_rank": 4}, 8
    )
    assert lora_serving_problem({"enable_lora": True, "max_lora_rank": 8}, 8) is None
