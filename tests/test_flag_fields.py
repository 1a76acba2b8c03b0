"""A flag declared once, as a typed config's field: the parser's default is the field's, the config is built from
the parsed flags, and slime's names come from the fields."""

import argparse
import dataclasses

import pytest

from slime_search.arguments import build_parser, parse_args
from slime_search.compat.flags import declared_in_fields, vocabulary
from slime_search.config.checkpoints import CheckpointConfig
from slime_search.config.cluster import ClusterConfig
from slime_search.config.engines import EngineConfig
from slime_search.config.logs import LogConfig
from slime_search.config.lora import LoraConfig
from slime_search.config.loss import LossConfig
from slime_search.config.model import ModelArgs
from slime_search.config.optim import OptimConfig
from slime_search.config.rollout import DataConfig, RolloutConfig, RolloutManagerConfig, SamplingConfig
from slime_search.config.training import ImportanceWeightsConfig, TrainingConfig
from slime_search.evaluation.flags import EvalConfig
from slime_search.evaluation.subsets import EvalSubset
from slime_search.health.config import HealthConfig, health_config
from slime_search.rollout.schedule import ScheduleConfig
from slime_search.run.config import actor_config, run_config
from slime_search.search_r1.config import RewardConfig, SearchR1Config
from slime_search.utils.flag_fields import (
    REQUIRED,
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


@dataclasses.dataclass(frozen=True)
class Shaped:
    path: str = flag(REQUIRED, "where", name="--path")
    pairs: tuple[str, ...] = flag((), "name and path pairs", nargs="+", metavar="NAME PATH")
    estimator: str = flag(
        "grpo", "which", choices=("grpo", "dr_grpo"), switches=(("--no-std", "dr_grpo", "the same as dr_grpo", True),)
    )
    size: int | None = flag(None, "how many", type=positive_int, exclusive="size")
    width: float | None = flag(None, "how wide", type=float, exclusive="size")


def test_required_list_switch_and_exclusive_flags_are_declared_from_their_fields():
    parser = argparse.ArgumentParser()
    add_flags(parser, Shaped)
    with pytest.raises(SystemExit):
        parser.parse_args([])  # --path is required: the field has no default
    args = parser.parse_args(["--path", "p", "--pairs", "a", "b", "--no-std", "--size", "3"])
    assert from_flags(Shaped, args) == Shaped("p", ("a", "b"), "dr_grpo", 3, None)  # the list is kept as a tuple
    with pytest.raises(SystemExit):
        parser.parse_args(["--path", "p", "--size", "3", "--width", "0.1"])  # one of the exclusive pair
    assert slime_flag_names([Shaped]) == ["--no-std"]
    with pytest.raises(TypeError, match="immutable"):
        flag([], "a list default would be shared by every config")
    with pytest.raises(TypeError, match=r"no flag fields \['depth'\]"):
        add_flags(argparse.ArgumentParser(), Shaped, only=("depth",))


FLAG_CLASSES = [
    CheckpointConfig, ClusterConfig, EngineConfig, DataConfig, RolloutConfig, SamplingConfig, RolloutManagerConfig,
    TrainingConfig, ImportanceWeightsConfig, LossConfig, OptimConfig, ScheduleConfig, EvalConfig, EvalSubset, LogConfig,
    HealthConfig, SearchR1Config, RewardConfig, ModelArgs, LoraConfig,
]  # fmt: skip


@pytest.mark.parametrize("config_class", FLAG_CLASSES)
def test_the_parsers_defaults_are_the_configs_own(config_class):
    """The drift this prevents: a parser default and a dataclass default for one flag, kept apart by hand."""
    parser = build_parser()
    fields = flag_fields(config_class)
    with_defaults = [f for f in fields if f.default is not dataclasses.MISSING]
    assert fields and all(parser.get_default(flag_dest(f)) == f.default for f in with_defaults)
    help_text = parser.format_help()
    assert all(flag_name(f) in help_text for f in fields)


def test_every_training_flag_is_declared_once_by_a_field_or_slimes_vocabulary():
    """No add_argument beside the fields: each option of the parser comes from exactly one declaration (slime's
    accepted and refused flags are the vocabulary's data)."""
    from slime_search.compat.flags import add_slime_flags

    declared: list[str] = []
    for config_class in FLAG_CLASSES:
        for field in flag_fields(config_class):
            spec = field.metadata["flag"]
            declared += [flag_name(field), *spec.aliases, *(switch for switch, *_ in spec.switches)]
            if isinstance(field.default, bool) and (field.default or spec.negatable) and spec.nargs is None:
                declared.append("--no-" + flag_name(field).removeprefix("--"))
    vocabulary_parser = argparse.ArgumentParser(add_help=False)
    add_slime_flags(vocabulary_parser)
    declared += [name for action in vocabulary_parser._actions for name in action.option_strings]
    parser_names = [name for action in build_parser()._actions for name in action.option_strings]
    assert sorted(parser_names) == sorted(["-h", "--help", *declared])
    assert len(set(declared)) == len(declared)


def test_a_config_built_in_code_is_checked_as_its_flags_are():
    with pytest.raises(ValueError, match="--recompute-granularity full needs --recompute-method"):
        ClusterConfig(recompute_granularity="full")
    with pytest.raises(ValueError, match="--recompute-method and --recompute-num-layers go with"):
        ClusterConfig(recompute_method="uniform")
    assert ClusterConfig(actor_num_nodes=2, actor_num_gpus_per_node=4).actor_gpus == 8
    with pytest.raises(ValueError, match=r"--mis-lower \(by default 1 / --mis-upper = 2\) must be below"):
        ImportanceWeightsConfig(use_mis=True, mis_upper=0.5)
    with pytest.raises(ValueError, match="takes pairs"):
        EvalConfig(prompt_data=("nq",))
    with pytest.raises(ValueError, match="add --eval-engine"):
        EvalConfig(engine_url="http://e")
    assert EvalConfig(prompt_data=("nq", "a", "hotpotqa", "b")).sets == (("nq", "a"), ("hotpotqa", "b"))


def test_the_rollout_side_is_built_from_its_fields():
    args = parse_args([
        *BASE, "--rollout-shuffle", "--rollout-seed", "7", "--rollout-top-p", "0.9", "--rollout-max-response-len",
        "64", "--disable-grpo-std-normalization", "--reward-key", "em", "--cpu-engine-args=--decode-delay-ms 20",
        "--eval-prompt-data", "nq", "nq.jsonl", "--eval-sample", "5",
    ])  # fmt: skip
    built = run_config(args, vocab_size=100, use_gpu=False).rollout
    assert built.data == DataConfig("p.parquet", shuffle=True, seed=7)
    assert built.rollout == RolloutConfig(4, 8, reward_key="em", normalize_advantages_std=False)
    assert built.sampling_params == {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 64, "sampling_seed": 7}
    assert built.eval_sampling_params == {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 64}
    assert (built.eval_sets, built.eval_subset) == ((("nq", "nq.jsonl"),), EvalSubset(size=5))
    assert built.engines.cpu_engine_args == ("--decode-delay-ms", "20")
    assert built.generate_path == RolloutManagerConfig.__dataclass_fields__["generate_path"].default


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


def test_the_converters_require_the_models_shape_and_training_reads_it_from_config_json():
    from slime_search.backends.megatron.model_args import add_model_arguments

    converter = add_model_arguments(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        converter.parse_args(["--num-layers", "2"])  # --hidden-size and the rest of the shape are missing
    training = add_model_arguments(argparse.ArgumentParser(), required=False)
    assert from_flags(ModelArgs, training.parse_args([])) == ModelArgs()
