"""A flag declared once, as a typed config's field: the parser's default is the field's, the config is built from
the parsed flags, and slime's names come from the fields."""

import argparse
import dataclasses

import pytest

from slime_search.arguments import build_parser, parse_args
from slime_search.compat.flags import declared_in_fields, vocabulary
from slime_search.config.engines import EngineConfig
from slime_search.config.loss import LossConfig
from slime_search.config.optim import OptimConfig
from slime_search.health.config import HealthConfig, health_config
from slime_search.rollout.schedule import ScheduleConfig
from slime_search.run_config import actor_config, run_config
from slime_search.search_r1.config import SearchR1Config
from slime_search.utils.flag_fields import (
    add_flags,
    flag,
    flag_dest,
    flag_fields,
    flag_name,
    from_flags,
    slime_flag_names,
)
from slime_search.utils.flag_types import positive_int

BASE = [
    "--hf-checkpoint", "ckpt", "--save", "run", "--prompt-data", "p.parquet", "--num-rollout", "2",
    "--rollout-batch-size", "4", "--n-samples-per-prompt", "8",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Example:
    width: int = flag(4, "how wide", type=positive_int, slime=True)
    style: str = flag("plain", "how it looks", choices=["plain", "bold"], aliases=("--look",), slime="--look")
    verbose: bool = flag(False, "say more")
    checked: bool = flag(True, "check it")
    derived: int = 0  # not a flag: computed from others


def test_a_config_class_declares_its_flags_and_is_built_back_from_them():
    parser = argparse.ArgumentParser()
    add_flags(parser, Example)
    assert from_flags(Example, parser.parse_args([])) == Example()
    args = parser.parse_args(["--width", "7", "--look", "bold", "--verbose", "--no-checked"])
    assert from_flags(Example, args, derived=3) == Example(7, "bold", True, False, 3)
    with pytest.raises(SystemExit):
        parser.parse_args(["--width", "0"])  # the converter's rule: a usage error
    with pytest.raises(SystemExit):
        parser.parse_args(["--style", "italic"])
    with pytest.raises(TypeError, match=r"no fields \['depth'\]"):
        from_flags(Example, args, depth=1)
    assert [flag_name(f) for f in flag_fields(Example)] == ["--width", "--style", "--verbose", "--checked"]
    assert slime_flag_names([Example]) == ["--width", "--look"]
    with pytest.raises(ValueError, match="not among the aliases"):
        flag(1, "x", slime="--other")


@pytest.mark.parametrize(
    "config_class", [EngineConfig, OptimConfig, LossConfig, ScheduleConfig, HealthConfig, SearchR1Config]
)
def test_the_parsers_defaults_are_the_configs_own(config_class):
    """The drift this prevents: a parser default and a dataclass default for one flag, kept apart by hand."""
    parser = build_parser()
    fields = flag_fields(config_class)
    assert fields and all(parser.get_default(flag_dest(f)) == f.default for f in fields)
    help_text = parser.format_help()
    assert all(flag_name(f) in help_text for f in fields)


def test_the_configs_built_from_default_flags_are_the_default_configs():
    args = parse_args(BASE)
    assert actor_config(args, vocab_size=100).optim == OptimConfig()
    assert actor_config(args, vocab_size=100).loss == LossConfig(vocab_size=100)
    assert health_config(args) == HealthConfig()
    built = run_config(args, vocab_size=100, use_gpu=False)
    assert built.schedule == ScheduleConfig()
    assert built.rollout.engines == EngineConfig(model_path="ckpt", seed=parse_args(BASE).seed)
    fully = parse_args([*BASE, "--async-mode", "fully", "--max-staleness", "3", "--async-batch-order", "admission"])
    assert run_config(fully, vocab_size=100, use_gpu=False).schedule == ScheduleConfig("fully", 3, None, "admission")
    task = SearchR1Config.from_args(argparse.Namespace(**{**vars(args), "engine_url": "http://e"}))
    assert task == SearchR1Config(engine_urls=("http://e",), tokenizer_path="ckpt", serper_ledger=task.serper_ledger)
    guarded = parse_args([*BASE, "--health-grad-spike", "4", "--no-health-guard", "--max-rollbacks", "0"])
    assert (health_config(guarded).grad_spike, health_config(guarded).enabled) == (4.0, False)
    assert health_config(guarded).max_rollbacks == 0


def test_slimes_spellings_reach_the_loss_config():
    args = parse_args([*BASE, "--loss-type", "sft_loss", "--tis-clip", "3"])
    loss = actor_config(args, vocab_size=100).loss
    assert (loss.loss_type, loss.tis_cap) == ("sft", 3.0)
    with pytest.raises(ValueError, match="unknown --kl-loss-type 'k4'"):
        LossConfig(kl_loss_type="k4")


def test_the_optimizer_flags_reach_the_optimizer_config():
    given = parse_args([*BASE, "--lr", "3e-4", "--adam-beta2", "0.95", "--lr-decay-style", "cosine"])
    optim = actor_config(given, vocab_size=100).optim
    assert (optim.lr, optim.adam_beta2, optim.lr_decay_style) == (3e-4, 0.95, "cosine")
    assert optim.lr_decay_iters == 2  # derived: the whole run (2 rollouts, one optimizer step each)


def test_an_optim_config_built_in_code_is_checked_as_its_flags_are():
    with pytest.raises(ValueError, match=r"adam_beta2 must be in \[0, 1\), got 1.0"):
        OptimConfig(adam_beta2=1.0)
    with pytest.raises(ValueError, match="lr must be >= 0, got -1"):
        OptimConfig(lr=-1)
    with pytest.raises(ValueError, match="lr_decay_style must be one of"):
        OptimConfig(lr_decay_style="step")


def test_slimes_names_are_honoured_from_the_fields_and_named_nowhere_else():
    names = declared_in_fields()
    assert {"--lr", "--min-lr", "--adam-beta1", "--adam-beta2", "--clip-grad", "--optimizer"} <= set(names)
    assert {"--loss-type", "--eps-clip-high", "--use-tis", "--tis-clip"} <= set(names)
    assert {"--rollout-num-gpus", "--rollout-num-gpus-per-engine", "--sglang-mem-fraction-static"} <= set(names)
    assert "--tis-cap" not in names and "--llds-coef" not in names  # ours, not slime's
    vocab = vocabulary()
    assert all(vocab.flags[name].answer == "honoured" for name in names)
    import tomllib

    from slime_search.compat.flags import DATA_FILE

    assert not set(names) & set(tomllib.loads(DATA_FILE.read_text())["honoured"])  # one declaration, not two
