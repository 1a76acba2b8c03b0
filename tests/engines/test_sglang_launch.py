"""SGLang launch: commands and GPU split; a real engine + router on a CUDA machine (on CPU: test_sglang_router.py)."""

import importlib.util

import pytest

from slime_search.engines.sglang_launch import SGLangEngineSpec, engine_specs, router_command


def test_engine_specs_split_gpus_into_engines():
    specs = engine_specs("/ckpt", num_gpus=8, gpus_per_engine=2, first_port=15000, mem_fraction_static=0.7)
    assert [(s.base_gpu_id, s.tp_size, s.port) for s in specs] == [
        (0, 2, 15000),
        (2, 2, 15001),
        (4, 2, 15002),
        (6, 2, 15003),
    ]
    command = specs[1].command()
    assert command[:2] == ["-m", "sglang.launch_server"]
    flags = dict(zip(command[2::2], command[3::2], strict=True))
    assert flags == {
        "--model-path": "/ckpt",
        "--host": "127.0.0.1",
        "--port": "15001",
        "--tp-size": "2",
        "--base-gpu-id": "2",
        "--mem-fraction-static": "0.7",
        "--weight-version": "0",  # the version before any push, as the CPU engine starts
    }
    with pytest.raises(ValueError, match="not a multiple"):
        engine_specs("/ckpt", num_gpus=3, gpus_per_engine=2, first_port=1)
    # no router health checks: SGLang's /health generates a token, which an engine that released its memory to a
    # colocated trainer must not do, and which outlasts the router's 5 s probe while a weight update holds it
    # the metrics on a port of the run's own: the router's default 29000 on 0.0.0.0 makes a second router exit
    assert router_command("127.0.0.1", 3000, metrics_port=3001) == [
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        "3000",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        "3001",
        "--disable-health-check",
        "--disable-circuit-breaker",
    ]


def test_engines_are_seeded_from_the_run_seed(monkeypatch):
    """--seed reaches SGLang as --random-seed, engine i with seed + i (different samples for the same prompt)."""
    from slime_search.engines import sglang_launch
    from slime_search.engines.deployment import EngineConfig, start_sglang_engines

    launched = []

    def launch(specs, *args, **kwargs):
        launched.extend(specs)
        raise RuntimeError("not started in this test")

    monkeypatch.setattr(sglang_launch, "launch", launch)
    with pytest.raises(RuntimeError, match="not started"):
        start_sglang_engines(EngineConfig("/ckpt", num_gpus=2, seed=7), gpu_ids=None)
    commands = [spec.command() for spec in launched]
    assert [command[command.index("--random-seed") + 1] for command in commands] == ["7", "8"]
    assert "--random-seed" not in engine_specs("/ckpt", num_gpus=1, gpus_per_engine=1, first_port=1)[0].command()


def test_colocated_engines_get_the_memory_saver_with_cuda_graphs_and_no_allocator_settings(monkeypatch):
    """Colocated engines release their CUDA graphs too (SGLANG_MEMORY_SAVER_CUDA_GRAPH=1, which the breakable prefill
    graph refuses: it is disabled), and PyTorch's allocator settings, which the memory saver does not take, are not
    passed on; engines on GPUs of their own keep SGLang's defaults."""
    from slime_search.engines import sglang_launch
    from slime_search.engines.deployment import EngineConfig, start_sglang_engines

    launched = {}

    def launch(specs, *args, **kwargs):
        launched.update(specs=specs, **kwargs)
        raise RuntimeError("not started in this test")

    monkeypatch.setattr(sglang_launch, "launch", launch)
    colocated = EngineConfig("/ckpt", num_gpus=2, gpus_per_engine=2, memory_saver=True)
    with pytest.raises(RuntimeError, match="not started"):
        start_sglang_engines(colocated, gpu_ids=["0", "1"])
    command = launched["specs"][0].command()
    assert "--enable-memory-saver" in command
    assert command[command.index("--cuda-graph-backend-prefill") + 1] == "disabled"
    assert launched["env"] == {"CUDA_VISIBLE_DEVICES": "0,1", "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}
    assert "PYTORCH_CUDA_ALLOC_CONF" in launched["unset_env"] and "PYTORCH_ALLOC_CONF" in launched["unset_env"]
    with pytest.raises(RuntimeError, match="not started"):
        start_sglang_engines(EngineConfig("/ckpt", num_gpus=2, gpus_per_engine=2), gpu_ids=None)
    assert not {"--enable-memory-saver", "--cuda-graph-backend-prefill"} & set(launched["specs"][0].command())
    assert (launched["env"], launched["unset_env"]) == ({}, ())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_pinned_sglang_parses_the_colocated_engine_flags(tiny_checkpoint):
    """SGLang 0.5.23's own argument parser (the CPU test environment) takes the memory-saver flags as given."""
    import os
    import subprocess

    from slime_search.engines.sglang_launch import MEMORY_SAVER_ARGS
    from tests import sglang_cpu

    python = sglang_cpu.python()  # skips without the environment
    script = (
        "import sys; from sglang.srt.server_args import prepare_server_args; "
        "a = prepare_server_args(sys.argv[1:]); print(a.enable_memory_saver, a.cuda_graph_backend_prefill)"
    )
    argv = [python, "-c", script, "--model-path", str(tiny_checkpoint), "--device", "cpu", *MEMORY_SAVER_ARGS]
    env = {**os.environ, **sglang_cpu.CPU_ENV}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["True", "disabled"]


@pytest.mark.gpu
@pytest.mark.timeout(1200)
def test_real_sglang_engine_behind_router(tiny_checkpoint):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None:
        pytest.skip("needs a CUDA GPU with SGLang installed (pip install -e '.[gpu]')")
    import httpx

    from slime_search.engines.sglang_launch import launch

    deployment = launch(
        [SGLangEngineSpec(str(tiny_checkpoint), port=31000, mem_fraction_static=0.3)], "127.0.0.1", 31100
    )
    try:
        out = httpx.post(
            f"{deployment.router_url}/generate",
            json={
                "input_ids": [9707, 1879],
                "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
                "return_logprob": True,
            },
            timeout=120,
        ).json()
        assert len(out["output_ids"]) == len(out["meta_info"]["output_token_logprobs"]) == 4
    finally:
        deployment.stop()
