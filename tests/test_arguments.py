"""slime-style training flags: validation, the model flags checked against config.json, derived configs."""

import pytest

from slime_search.arguments import actor_config, check_model_flags, parse_args, steps_per_rollout, weight_transport

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


def test_colocate_takes_the_actors_gpus_and_a_transport_that_works_on_one_gpu():
    args = parse("--colocate", "--actor-num-gpus-per-node", "4")
    assert weight_transport(args) == "tensor"
    assert weight_transport(parse("--colocate", "--update-weight-transport", "disk")) == "disk"
    with pytest.raises(
        SystemExit, match="NCCL cannot connect two processes on one GPU; use --update-weight-transport disk or tensor"
    ):
        parse("--colocate", "--update-weight-transport", "nccl")
    with pytest.raises(SystemExit, match="actor's 4 GPUs"):
        parse("--colocate", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "2")
    with pytest.raises(SystemExit, match="drop --engine-url"):
        parse("--colocate", "--engine-url", "http://127.0.0.1:1")


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


def test_run_config_derives_every_component_config_once_and_leaves_the_flags_alone():
    from slime_search.arguments import run_config

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


def test_async_modes_are_refused_where_generation_cannot_overlap_training():
    from slime_search.arguments import run_config
    from slime_search.rollout.schedule import ScheduleConfig

    assert run_config(parse("--async-mode", "fully"), 100, use_gpu=False).schedule == ScheduleConfig("fully", 2)
    assert ScheduleConfig("one-step", 5).staleness == 1 and ScheduleConfig("fully", 3).staleness == 3
    with pytest.raises(SystemExit, match="engines on GPUs of their own"):
        parse("--async-mode", "one-step", "--colocate")
    with pytest.raises(SystemExit, match="applies to RL"):
        parse("--async-mode", "fully", "--loss-type", "sft")
    with pytest.raises(SystemExit, match="--max-staleness must be >= 1"):
        parse("--async-mode", "fully", "--max-staleness", "0")
    with pytest.raises(SystemExit):  # argparse lists the modes
        parse("--async-mode", "sometimes")


def test_several_running_engines_are_given_by_address():
    from slime_search.engines.deployment import EngineConfig, start_engines

    engines = start_engines(EngineConfig("ckpt", engine_url="http://a:1, http://b:2"), log_dir=".")
    assert engines.url == "http://a:1" and engines.worker_urls == ["http://a:1", "http://b:2"]
    assert engines.find_down() == [] and engines.slots == {}  # engines given by address are never restarted
