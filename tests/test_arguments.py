"""slime-style training flags: validation, the model flags checked against config.json, derived configs."""

import pytest

from slime_search.arguments import actor_config, check_model_flags, parse_args, steps_per_rollout

BASE = ["--hf-checkpoint", "ckpt", "--save", "run", "--prompt-data", "p.parquet", "--num-rollout", "2"]


def parse(*extra):
    return parse_args([*BASE, "--rollout-batch-size", "4", "--n-samples-per-prompt", "8", *extra])


def test_global_batch_size_sets_optimizer_steps_per_rollout_and_must_divide_the_rollout():
    assert steps_per_rollout(parse()) == 1
    assert steps_per_rollout(parse("--global-batch-size", "8")) == 4
    with pytest.raises(SystemExit):
        parse("--global-batch-size", "12")


def test_kl_needs_the_switch_that_loads_the_reference_model():
    with pytest.raises(SystemExit):
        parse("--kl-loss-coef", "0.001")
    args = parse("--use-kl-loss", "--kl-loss-coef", "0.001")
    assert actor_config(args, vocab_size=100).loss.kl_coef == 0.001
    with pytest.raises(SystemExit):
        parse("--use-kl-loss", "--loss-type", "sft")


def test_model_flags_from_scripts_are_checked_against_the_checkpoint(tiny_checkpoint):
    from transformers import AutoConfig

    from tests.test_megatron_convert import model_args

    config = AutoConfig.from_pretrained(tiny_checkpoint)
    check_model_flags(parse(*model_args("tiny-qwen2")), config)  # the tiny model's own script agrees
    check_model_flags(parse(), config)  # no model flags: nothing to check
    with pytest.raises(ValueError, match="--num-layers"):
        check_model_flags(parse(*model_args("qwen2.5-3B")), config)


def test_colocate_needs_rollout_gpus():
    with pytest.raises(SystemExit):
        parse("--colocate")
