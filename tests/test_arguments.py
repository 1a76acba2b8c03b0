"""slime-style training flags: validation, the model flags checked against config.json, derived configs."""

import pytest

from slime_search.arguments import check_model_flags, parse_args
from slime_search.run.config import actor_config, model_source, steps_per_rollout, weight_transport

BASE = ["--hf-checkpoint", "ckpt", "--save", "run", "--prompt-data", "p.parquet", "--num-rollout", "2"]


def parse(*extra):
    return parse_args([*BASE, "--rollout-batch-size", "4", "--n-samples-per-prompt", "8", *extra])


def usage_error(capsys, *extra) -> str:
    """`parse(*extra)` refused as argparse refuses a value (exit code 2, no traceback); its message."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        parse(*extra)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage:") and "Traceback" not in err
    return err


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

    from tests.backends.test_megatron_convert import model_args

    config = AutoConfig.from_pretrained(tiny_checkpoint)
    check_model_flags(parse(*model_args("tiny-qwen2")), config)  # the tiny model's own script agrees
    check_model_flags(parse(), config)  # no model flags: nothing to check
    with pytest.raises(ValueError, match="--num-layers"):
        check_model_flags(parse(*model_args("qwen2.5-3B")), config)


def test_weight_transport_defaults_to_the_fastest_one_the_placement_allows():
    assert weight_transport(parse()) == "disk"  # the CPU engine, unless asked otherwise
    assert weight_transport(parse("--rollout-num-gpus", "4")) == "nccl"
    assert weight_transport(parse("--update-weight-transport", "tensor")) == "tensor"
    with pytest.raises(SystemExit):
        parse("--update-weight-buffer-size", "0")
    with pytest.raises(SystemExit):  # argparse lists the registry's names
        parse("--update-weight-transport", "smoke-signals")


def test_colocate_takes_the_actors_gpus_and_a_transport_that_works_on_one_gpu(capsys):
    args = parse("--colocate", "--actor-num-gpus-per-node", "4")
    assert weight_transport(args) == "tensor"
    assert weight_transport(parse("--colocate", "--update-weight-transport", "disk")) == "disk"
    refused = "NCCL cannot connect two processes on one GPU; use --update-weight-transport disk or tensor"
    assert refused in usage_error(capsys, "--colocate", "--update-weight-transport", "nccl")
    assert "actor's 4 GPUs" in usage_error(
        capsys, "--colocate", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "2"
    )
    assert "drop --engine-url" in usage_error(capsys, "--colocate", "--engine-url", "http://127.0.0.1:1")
    assert "not a multiple of --rollout-num-gpus-per-engine 2" in usage_error(
        capsys, "--colocate", "--actor-num-gpus-per-node", "3", "--rollout-num-gpus-per-engine", "2"
    )


def test_the_3b_run_script_passes_only_flags_the_driver_accepts():
    import os
    import subprocess

    from tests.conftest import REPO_ROOT

    script = REPO_ROOT / "examples" / "search-r1" / "run_qwen2.5_3B.sh"
    env = {**os.environ, "DRY_RUN": "1", "USE_TIS": "1"}
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True).stdout
    command = out.splitlines()
    assert command[1].endswith("/train.py")
    args = parse_args(command[2:])
    assert (args.tensor_model_parallel_size, args.sequence_parallel, args.use_tis) == (2, True, True)
    assert (args.kl_loss_type, args.kl_loss_coef, args.eps_clip, args.eps_clip_high) == ("low_var_kl", 0.001, 0.2, 0.28)
    assert args.num_layers == 36 and steps_per_rollout(args) == 1
    assert (args.rollout_num_gpus, args.colocate, weight_transport(args)) == (4, False, "nccl")


def test_the_3b_run_script_with_lora_rank_trains_adapters_at_ten_times_the_rate():
    import os
    import subprocess

    from tests.conftest import REPO_ROOT

    for name in ("run_qwen2.5_3B.sh", "run_qwen3_4B.sh"):
        script = REPO_ROOT / "examples" / "search-r1" / name
        env = {**os.environ, "DRY_RUN": "1", "LORA_RANK": "32"}
        out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True).stdout
        args = parse_args(out.splitlines()[2:])
        source = model_source(args)
        assert (source.lora.lora_rank, source.lora.lora_alpha, args.lr) == (32, 32.0, 1e-5), name
        assert source.lora.projections == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), name
        assert source.model_overrides["attention_impl"] == "packed", name  # the adapters wrap the local linears
        # slime's recipe gives --ref-load the --load weights: under LoRA the reference is the model, adapters off
        assert source.with_reference and source.ref_load == source.load, name
        assert not source.lora.lora_sync_from_tensor, name  # each push carries the folded weights
        env["LORA_SYNC_FROM_TENSOR"] = "1"
        out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True).stdout
        assert model_source(parse_args(out.splitlines()[2:])).lora.served_adapter == "policy", name


def test_the_qwen3_4b_run_script_trains_qwen3_with_native_tool_calls_and_thinking_off():
    import os
    import subprocess

    from tests.conftest import REPO_ROOT

    script = REPO_ROOT / "examples" / "search-r1" / "run_qwen3_4B.sh"
    for env, thinking in (({}, False), ({"ENABLE_THINKING": "1"}, True)):
        run = subprocess.run(
            ["bash", str(script)], env={**os.environ, "DRY_RUN": "1", **env}, capture_output=True, text=True, check=True
        )
        args = parse_args(run.stdout.splitlines()[2:])
        assert (args.tool_format, args.enable_thinking, args.qk_layernorm, args.kv_channels) == (
            "qwen3",
            thinking,
            True,
            128,
        )
        assert (args.num_layers, args.hidden_size, args.add_qkv_bias) == (36, 2560, False)
        assert args.hf_checkpoint == "models/Qwen3-4B" and args.tensor_model_parallel_size == 2


def test_the_3b_run_script_colocated():
    import os
    import subprocess

    from tests.conftest import REPO_ROOT

    script = REPO_ROOT / "examples" / "search-r1" / "run_qwen2.5_3B.sh"
    env = {**os.environ, "DRY_RUN": "1", "COLOCATE": "1", "ACTOR_GPUS": "8"}
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True).stdout
    args = parse_args(out.splitlines()[2:])
    assert (args.colocate, args.rollout_num_gpus, weight_transport(args)) == (True, 0, "tensor")
    assert (args.actor_num_gpus_per_node, args.sglang_mem_fraction_static) == (8, 0.5)
    # LoRA pushing the adapters alone, colocated: the engines keep their base weights through training
    env |= {"LORA_RANK": "32", "LORA_SYNC_FROM_TENSOR": "1"}
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True).stdout
    args = parse_args(out.splitlines()[2:])
    assert args.colocate and model_source(args).lora.served_adapter == "policy"


def test_the_3b_run_scripts_search_r1_recipe_is_search_r1s_step(capsys):
    """RECIPE=search-r1: Search-R1's train_grpo.sh and verl's defaults (examples/search-r1/README.md's table), read
    back through the parser and run_config, as the trainer builds them."""
    import os
    import subprocess

    from tests.conftest import REPO_ROOT

    script = REPO_ROOT / "examples" / "search-r1" / "run_qwen2.5_3B.sh"

    def recipe(**env):
        done = subprocess.run(
            ["bash", str(script)], env={**os.environ, "DRY_RUN": "1", **env}, capture_output=True, text=True
        )
        return done.returncode, done.stdout.splitlines()[2:], done.stderr

    code, flags, _ = recipe(RECIPE="search-r1")
    args = parse_args(flags)
    config = actor_config(args, vocab_size=151936)
    assert code == 0 and (args.rollout_batch_size, args.n_samples_per_prompt, args.global_batch_size) == (512, 5, 256)
    assert steps_per_rollout(args) == 10 and args.num_rollout == 1005
    # verl: int(0.285 x 1005) = 286 warm-up rollouts, 10 optimizer steps each here
    assert (config.optim.lr_warmup_iters, config.optim.adam_beta2, config.optim.weight_decay) == (2860, 0.999, 0.01)
    assert (config.loss.entropy_coef, config.loss.eps_clip, config.loss.eps_clip_high) == (0.001, 0.2, 0.2)
    assert (config.loss.reduction, config.loss.kl_coef, config.loss.kl_loss_type) == ("token_mean", 0.001, "low_var_kl")
    assert (args.rollout_top_p, args.use_tis) == (0.95, False)
    assert args.lr_decay_style == "constant" and args.lr == 1e-6
    # TIS needs the engine to sample the trainer's full distribution: with USE_TIS=1 top_p stays 1 (and parses)
    _, flags, _ = recipe(RECIPE="search-r1", USE_TIS="1")
    assert (parse_args(flags).rollout_top_p, parse_args(flags).use_tis) == (1.0, True)
    # a short validation run warms up over its own 28.5%
    _, flags, _ = recipe(RECIPE="search-r1", NUM_ROLLOUT="5")
    assert actor_config(parse_args(flags), vocab_size=151936).optim.lr_warmup_iters == 10
    # the default recipe is slime's, one step per rollout; an unknown recipe is refused by name
    _, flags, _ = recipe()
    slime = parse_args(flags)
    assert (slime.rollout_batch_size, steps_per_rollout(slime), slime.lr_warmup_iters) == (32, 1, 0)
    assert slime.eps_clip_high == 0.28
    assert (slime.rollout_top_p, slime.calculate_per_token_loss, slime.adam_beta2) == (1.0, False, 0.98)
    code, _, stderr = recipe(RECIPE="search_r1")
    assert code == 2 and "RECIPE=search_r1: use slime (the default) or search-r1" in stderr


def test_run_config_derives_every_component_config_once_and_leaves_the_flags_alone():
    from slime_search.run.config import run_config

    args = parse(
        "--colocate", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus-per-engine", "2",
        "--eval-prompt-data", "nq", "e.parquet", "--global-batch-size", "16", "--use-kl-loss",
    )  # fmt: skip
    flags = dict(vars(args))
    on_gpu = run_config(args, vocab_size=100, use_gpu=True)
    assert vars(args) == flags  # nothing derived is written back into the parsed flags
    engines = on_gpu.rollout.engines
    assert (engines.num_gpus, engines.gpus_per_engine, engines.memory_saver) == (4, 2, True)  # the actor's GPUs
    assert (on_gpu.weight_sync.transport, on_gpu.weight_sync.ranks_per_engine) == ("tensor", 2)
    assert on_gpu.weight_sync.disk_dir == "run/weights" and on_gpu.steps_per_rollout == 2
    assert on_gpu.rollout.eval_sets == (("nq", "e.parquet"),) and on_gpu.model.with_reference
    assert (on_gpu.train_group.num_ranks, on_gpu.train_group.use_gpu) == (4, True)
    on_cpu = run_config(args, vocab_size=100, use_gpu=False)  # colocated on CPU: the CPU engine, one rank
    assert (on_cpu.rollout.engines.num_gpus, on_cpu.weight_sync.ranks_per_engine) == (0, 1)
    assert on_cpu.eval_due(2) and not on_cpu.eval_due(1) and on_cpu.save_due(2) and not on_cpu.save_due(1)


def test_the_eval_engine_is_one_engine_of_its_own_with_the_runs_eval_sets(capsys):
    from slime_search.run.config import run_config

    evals = ("--eval-prompt-data", "nq", "e.parquet")
    args = parse(*evals, "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2", "--eval-engine")
    on_gpu = run_config(args, vocab_size=100, use_gpu=True).eval_engine
    assert (on_gpu.engines.num_gpus, on_gpu.engines.gpus_per_engine, on_gpu.engines.memory_saver) == (2, 2, False)
    assert on_gpu.eval_sets == (("nq", "e.parquet"),) and on_gpu.log_dir == "run/eval_engine"
    on_cpu = run_config(parse(*evals, "--eval-engine", "--cpu-engines", "3"), 100, use_gpu=False).eval_engine
    assert (on_cpu.engines.num_gpus, on_cpu.engines.cpu_engines, on_cpu.engines.engine_url) == (0, 1, None)
    given = parse(*evals, "--eval-engine", "--eval-engine-url", "http://127.0.0.1:9")
    assert run_config(given, 100, use_gpu=False).eval_engine.engines.engine_url == "http://127.0.0.1:9"
    assert run_config(parse(*evals), 100, use_gpu=False).eval_engine is None  # inside the step by default
    assert "needs --eval-prompt-data" in usage_error(capsys, "--eval-engine")
    assert "add --eval-engine" in usage_error(capsys, *evals, "--eval-engine-url", "http://127.0.0.1:9")


def test_the_3b_run_script_keeps_the_retriever_off_the_training_gpus():
    import os
    import subprocess

    from tests.conftest import REPO_ROOT

    script = REPO_ROOT / "examples" / "search-r1" / "run_qwen2.5_3B.sh"

    def retriever_line(**env) -> str:
        done = subprocess.run(["bash", str(script)], env={**os.environ, "DRY_RUN": "1", **env}, capture_output=True)
        return next(line for line in done.stderr.decode().splitlines() if line.startswith("retriever:"))

    on_cpu = retriever_line()
    assert "CUDA_VISIBLE_DEVICES= " in on_cpu and "--faiss-gpu" not in on_cpu  # no GPU at all by default
    own_gpu = retriever_line(RETRIEVER_GPUS="7", ROLLOUT_GPUS="2")
    assert "CUDA_VISIBLE_DEVICES=7 " in own_gpu and own_gpu.endswith("--faiss-gpu --fp16")


def test_async_modes_are_refused_where_generation_cannot_overlap_training(capsys):
    from slime_search.rollout.schedule import ScheduleConfig
    from slime_search.run.config import run_config

    assert run_config(parse("--async-mode", "fully"), 100, use_gpu=False).schedule == ScheduleConfig("fully", 2)
    assert ScheduleConfig("one-step", 5).staleness == 1 and ScheduleConfig("fully", 3).staleness == 3
    assert "engines on GPUs of their own" in usage_error(capsys, "--async-mode", "one-step", "--colocate")
    assert "applies to RL" in usage_error(capsys, "--async-mode", "fully", "--loss-type", "sft")
    assert "argument --max-staleness: must be >= 1, got 0" in usage_error(
        capsys, "--async-mode", "fully", "--max-staleness", "0"
    )
    assert "invalid choice: 'sometimes'" in usage_error(capsys, "--async-mode", "sometimes")  # argparse lists modes


def test_several_running_engines_are_given_by_address():
    from slime_search.engines.deployment import EngineConfig, start_engines

    engines = start_engines(EngineConfig("ckpt", engine_url="http://a:1, http://b:2"), log_dir=".")
    assert engines.url == "http://a:1" and engines.worker_urls == ["http://a:1", "http://b:2"]
    assert engines.find_down() == [] and engines.slots == {}  # engines given by address are never restarted


# Every numeric flag with the values that cannot work: each is refused when the command line is read.
REFUSED = [
    *[(flag, value) for flag in ("--rollout-concurrency", "--generation-concurrency", "--search-concurrency") for value in ("0", "-1")],
    *[(flag, value) for flag in ("--search-topk", "--n-samples-per-prompt", "--rollout-batch-size", "--global-batch-size") for value in ("0", "-1")],
    *[(flag, value) for flag in ("--max-tokens-per-gpu", "--cpu-engines", "--rollout-num-gpus-per-engine", "--engine-max-batch-size") for value in ("0", "-1")],
    *[(flag, value) for flag in ("--max-staleness", "--update-weight-buffer-size", "--rollout-max-response-len", "--max-response-tokens") for value in ("0", "-1")],
    *[(flag, value) for flag in ("--actor-num-nodes", "--actor-num-gpus-per-node", "--tensor-model-parallel-size", "--lr-decay-iters") for value in ("0", "-1")],
    *[(flag, value) for flag in ("--search-timeout", "--engine-timeout", "--engine-health-timeout", "--rollout-temperature") for value in ("0", "-1")],
    *[(flag, value) for flag in ("--tis-cap", "--tis-clip", "--mis-upper", "--mis-veto-threshold", "--max-answer-tags") for value in ("0", "-1")],
    *[(flag, value) for flag in ("--num-layers", "--hidden-size", "--make-vocab-size-divisible-by", "--max-position-embeddings") for value in ("0", "-1")],
    *[(flag, value) for flag in ("--rollout-top-p", "--sglang-mem-fraction-static") for value in ("0", "-1", "1.5")],
    *[(flag, value) for flag in ("--adam-beta1", "--adam-beta2") for value in ("-1", "1")],
    *[(flag, "-1") for flag in ("--num-rollout", "--keep-checkpoints", "--save-interval", "--eval-interval", "--log-rollout-examples")],
    *[(flag, "-1") for flag in ("--search-retries", "--engine-retries", "--search-preflight-timeout", "--max-turns", "--max-obs-tokens")],
    *[(flag, "-1") for flag in ("--lr", "--min-lr", "--lr-warmup-iters", "--weight-decay", "--clip-grad", "--eps-clip", "--eps-clip-high")],
    *[(flag, "-1") for flag in ("--kl-loss-coef", "--tis-clip-low", "--mis-lower", "--rollout-num-gpus", "--seed", "--rollout-seed")],
    ("--eps-clip-c", "1"), ("--eps-clip-c", "0"), ("--sglang-router-port", "-1"), ("--sglang-router-port", "70000"),
    ("--rollout-concurrency", "many"), ("--lr", "nan"),
]  # fmt: skip
# Numeric flags any value of which can work.
UNBOUNDED = {"--entropy-coef", "--structure-format-score", "--final-format-score", "--retrieval-score"}


@pytest.mark.parametrize(("flag", "value"), REFUSED)
def test_a_value_that_cannot_work_is_a_usage_error_naming_the_flag(capsys, flag, value):
    extra = ["--use-kl-loss"] if flag == "--kl-loss-coef" else []
    assert flag in usage_error(capsys, *extra, flag, value)


def test_every_numeric_flag_has_a_checked_type_or_a_refusal_test():
    from slime_search.arguments import build_parser

    refused = {flag for flag, _ in REFUSED}
    for action in build_parser()._actions:
        if action.option_strings and action.type is not None:
            names = set(action.option_strings)
            assert action.type not in (int, float) or names & (UNBOUNDED | refused), f"{names} is not range-checked"


@pytest.mark.parametrize("module", ["slime_search.arguments", "slime_search.eval"])
def test_every_flag_has_help_text(module):
    import importlib

    parser = importlib.import_module(module).build_parser()
    missing = [a.option_strings[0] for a in parser._actions if a.option_strings and not (a.help or "").strip()]
    assert missing == []


def test_engine_gpus_tensor_parallel_and_task_flags_are_usage_errors(capsys):
    assert "--rollout-num-gpus 3 is not a multiple of --rollout-num-gpus-per-engine 2" in usage_error(
        capsys, "--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"
    )
    assert "--tensor-model-parallel-size 2 must divide the actor's 3 ranks" in usage_error(
        capsys, "--actor-num-gpus-per-node", "3", "--tensor-model-parallel-size", "2"
    )
    # the Search-R1 plugin's check_args builds its settings now, not on the first sample inside a Ray actor
    assert "--max-turns 0 with --no-final-turn" in usage_error(capsys, "--max-turns", "0", "--no-final-turn")
    assert "--serper-replay-only needs --serper-cache" in usage_error(
        capsys, "--search-backend", "serper", "--serper-replay-only"
    )
    assert "module 'no_such_plugin' not found" in usage_error(
        capsys, "--custom-generate-function-path", "no_such_plugin.generate"
    )
    assert "has no attribute 'nothing'" in usage_error(
        capsys, "--custom-rm-path", "slime_search.search_r1.reward.nothing"
    )
    assert parse("--num-rollout", "0").num_rollout == 0  # no training: the final evaluation of the start weights


def qwen2_config(heads: int = 16, kv_heads: int = 2, ffn: int = 11008):
    """Qwen2.5-3B's config.json by default (16 query heads, 2 key/value heads), built offline; other widths given."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=151936, hidden_size=2048, num_hidden_layers=36, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=ffn, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=True, max_position_embeddings=32768,
    )  # fmt: skip


def test_sequence_parallel_without_tensor_parallelism_is_refused(capsys):
    error = usage_error(capsys, "--sequence-parallel")
    assert "--sequence-parallel" in error and "--tensor-model-parallel-size 2 or more" in error
    assert parse("--sequence-parallel", "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2")


def test_actor_tensor_parallelism_must_divide_the_3b_models_key_value_heads(capsys):
    from tests.backends.test_megatron_convert import model_args

    qwen3b = [*model_args("qwen2.5-3B"), "--actor-num-gpus-per-node", "4"]
    error = usage_error(capsys, *qwen3b, "--tensor-model-parallel-size", "4")
    assert "--tensor-model-parallel-size 4 must divide the model's 2 key/value heads (the model flags)" in error
    assert "use one of 1, 2" in error
    args = parse(*qwen3b, "--tensor-model-parallel-size", "2", "--sequence-parallel")
    check_model_flags(args, qwen2_config())  # the recipe's layout
    # without model flags the checkpoint's config.json says the same, before Ray or any engine starts
    tp4 = parse("--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "4")
    with pytest.raises(ValueError, match="must divide the model's 2 key/value heads \\(config.json\\)"):
        check_model_flags(tp4, qwen2_config())


@pytest.mark.parametrize(
    ("config", "refused"),
    [
        (dict(heads=12, kv_heads=12, ffn=64), "12 attention heads and 12 key/value heads"),
        (dict(heads=8, kv_heads=8, ffn=36), "36 MLP hidden size"),
    ],
)
def test_actor_tensor_parallelism_must_divide_the_attention_heads_and_the_mlp(config, refused):
    args = parse("--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "8")
    with pytest.raises(ValueError, match=f"size 8 must divide the model's {refused} \\(config.json\\)"):
        check_model_flags(args, qwen2_config(**config))
    check_model_flags(
        parse("--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "4"), qwen2_config(**config)
    )


def test_an_engine_tensor_parallel_size_sglang_refuses_is_refused(capsys):
    from tests.backends.test_megatron_convert import model_args

    qwen3b = model_args("qwen2.5-3B")
    error = usage_error(capsys, *qwen3b, "--rollout-num-gpus", "6", "--rollout-num-gpus-per-engine", "3")
    assert "--rollout-num-gpus-per-engine 3 (an SGLang engine's tensor-parallel size)" in error
    assert "use one of 1, 2" in error
    parse(*qwen3b, "--rollout-num-gpus", "8", "--rollout-num-gpus-per-engine", "4")  # SGLang replicates the 2 KV heads
    colocated = ("--colocate", "--actor-num-gpus-per-node", "6", "--rollout-num-gpus-per-engine", "3")
    assert "--rollout-num-gpus-per-engine 3" in usage_error(capsys, *qwen3b, *colocated)  # on the actor's GPUs
    with pytest.raises(ValueError, match="--rollout-num-gpus-per-engine 3"):
        check_model_flags(parse(*colocated), qwen2_config())


def test_slime_spellings_are_accepted(capsys):
    from slime_search.run.config import rollout_manager_config

    assert parse("--loss-type", "sft_loss").loss_type == "sft"
    assert parse("--tis-clip", "3").tis_cap == 3.0 and parse("--tis-cap", "3").tis_cap == 3.0
    args = parse("--disable-grpo-std-normalization")
    assert args.advantage_estimator == "dr_grpo" and parse().advantage_estimator == "grpo"
    assert not rollout_manager_config(args, engines=None).rollout.normalize_advantages_std
    assert parse("--optimizer", "adam").optimizer == "adam"
    assert "invalid choice: 'sgd'" in usage_error(capsys, "--optimizer", "sgd")


def test_dual_clip_per_token_loss_and_the_general_importance_weights_reach_the_loss(capsys):
    from slime_search.algo.importance import ISConfig

    loss = actor_config(parse("--eps-clip-c", "3", "--calculate-per-token-loss"), vocab_size=100).loss
    assert (loss.eps_clip_c, loss.reduction, loss.mis, loss.use_tis) == (3.0, "token_mean", None, False)
    assert actor_config(parse(), vocab_size=100).loss.reduction == "sequence_mean"
    mis = ["--use-mis", "--mis-level", "sequence", "--mis-mode", "mask", "--mis-upper", "3", "--mis-lower", "0.5"]
    loss = actor_config(parse(*mis, "--mis-veto-threshold", "1e-4"), vocab_size=100).loss
    assert loss.mis == ISConfig("sequence", "mask", 3.0, 0.5, veto_threshold=1e-4, batch_normalize=True)
    assert not actor_config(parse("--use-mis", "--no-mis-batch-normalize"), 100).loss.mis.batch_normalize
    assert "not both" in usage_error(capsys, "--use-mis", "--use-tis")
    assert "--mis-lower (by default 1 / --mis-upper = 2) must be below --mis-upper 0.5" in usage_error(
        capsys, "--use-mis", "--mis-upper", "0.5"
    )
    assert "--mis-lower 3 must be below --mis-upper 3" in usage_error(
        capsys, "--use-mis", *mis[-4:-2], "--mis-lower", "3"
    )
    assert "--tis-clip-low 2 must be below --tis-clip 2" in usage_error(capsys, "--use-tis", "--tis-clip-low", "2")
    for weights in ("--use-tis", "--use-mis"):
        assert "--rollout-top-p 0.9 with --use-tis/--use-mis" in usage_error(capsys, weights, "--rollout-top-p", "0.9")
    assert parse("--rollout-top-p", "0.9").rollout_top_p == 0.9  # without importance weights a nucleus is fine


def test_tis_clip_low_clamps_the_weights_from_below():
    import math

    import torch

    from slime_search.algo.importance import compute_is_weights, vanilla_tis_weights

    old = torch.tensor([math.log(0.25), math.log(1.5), math.log(3.0)])  # rollout log-probs 0: the ratios themselves
    rollout, mask = torch.zeros(3), torch.ones(3)
    plain = actor_config(parse("--use-tis"), vocab_size=100).loss
    assert plain.use_tis and plain.mis is None
    assert vanilla_tis_weights(old, rollout, plain.tis_cap).tolist() == pytest.approx([0.25, 1.5, 2.0])
    low = actor_config(parse("--use-tis", "--tis-clip-low", "0.5"), vocab_size=100).loss
    assert not low.use_tis and not low.mis.batch_normalize
    # slime's clamp(w, 0.5, 2): 0.25 -> 0.5, 1.5 stays, 3 -> 2
    assert compute_is_weights(old, rollout, mask, [3], low.mis).weights.tolist() == pytest.approx([0.5, 1.5, 2.0])


def test_a_decay_style_without_decay_iters_decays_over_the_whole_run():
    from slime_search.backends.megatron.optimizer import learning_rate

    # 2 rollouts x 4 optimizer steps each (32 samples / --global-batch-size 8)
    args = parse("--lr-decay-style", "cosine", "--global-batch-size", "8", "--lr", "1e-3", "--min-lr", "1e-4")
    optim = actor_config(args, vocab_size=100).optim
    assert optim.lr_decay_iters == 8
    assert [learning_rate(step, optim) for step in (0, 4, 8)] == pytest.approx([1e-3, 5.5e-4, 1e-4])
    assert actor_config(parse("--lr-decay-style", "linear", "--lr-decay-iters", "5"), 100).optim.lr_decay_iters == 5
    assert actor_config(parse(), vocab_size=100).optim.lr_decay_iters is None  # constant


def test_seed_reaches_the_actor_ranks_and_the_engines(monkeypatch):
    from slime_search.backends.megatron import distributed
    from slime_search.ray.train_group import TrainRank
    from slime_search.run.config import run_config

    config = run_config(parse("--seed", "99"), vocab_size=100, use_gpu=False)
    assert config.train_group.seed == 99 and config.rollout.engines.seed == 99
    calls = []
    monkeypatch.setattr(distributed, "init_megatron", lambda *args, **kw: calls.append((args, kw)))
    TrainRank(0, 1, 1).init_distributed("127.0.0.1", 1234, config.train_group.seed)
    assert calls == [((0, 1, 1, 1234, "127.0.0.1"), {"seed": 99})]


def test_model_flags_that_shape_the_model_are_passed_to_it():
    from types import SimpleNamespace

    from slime_search.backends.megatron.model import ModelOptions
    from slime_search.run.config import model_source

    hf_config = SimpleNamespace(rope_theta=1e6, max_position_embeddings=4096, rms_norm_eps=1e-6)
    overrides = model_source(parse()).model_overrides
    assert "make_vocab_size_divisible_by" not in overrides and "max_position_embeddings" not in overrides
    options = ModelOptions.from_hf_config(hf_config, **overrides)
    assert (options.make_vocab_size_divisible_by, options.max_position_embeddings) == (128, 4096)
    flags = ("--make-vocab-size-divisible-by", "100", "--max-position-embeddings", "2048")
    options = ModelOptions.from_hf_config(hf_config, **model_source(parse(*flags)).model_overrides)
    assert (options.make_vocab_size_divisible_by, options.max_position_embeddings) == (100, 2048)


def test_recompute_flags_follow_megatrons_rules_and_reach_the_model_options(capsys):
    from slime_search.run.config import model_source

    full = parse("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
    overrides = model_source(full).model_overrides
    assert (overrides["recompute_granularity"], overrides["recompute_method"], overrides["recompute_num_layers"]) == (
        "full",
        "uniform",
        1,
    )
    assert model_source(parse("--recompute-granularity", "selective")).model_overrides["recompute_method"] is None
    assert model_source(parse()).model_overrides["recompute_granularity"] is None
    assert "needs --recompute-method" in usage_error(capsys, "--recompute-granularity", "full")
    assert "go with --recompute-granularity full only" in usage_error(
        capsys, "--recompute-granularity", "selective", "--recompute-num-layers", "2"
    )
    assert "go with --recompute-granularity full only" in usage_error(capsys, "--recompute-method", "block")


def test_the_driver_refuses_a_layout_the_checkpoint_cannot_take_as_a_usage_error(tiny_checkpoint, tmp_path, capsys):
    """Without model flags only config.json knows the heads: the driver says so with exit code 2, before Ray starts
    (the tiny model has 2 key/value heads), not with a traceback."""
    from slime_search.train import main

    argv = [
        *BASE,
        "--hf-checkpoint",
        str(tiny_checkpoint),
        "--save",
        str(tmp_path / "run"),
        "--search-preflight-timeout",
        "0",
    ]
    argv += ["--rollout-batch-size", "4", "--n-samples-per-prompt", "8"]
    argv += ["--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "4"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "error: --tensor-model-parallel-size 4 must divide the model's 2 key/value heads (config.json)"
    )
    assert not (tmp_path / "run").exists()  # nothing was started
