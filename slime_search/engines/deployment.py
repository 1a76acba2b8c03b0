"""Which engines serve a run, and starting them: SGLang engines behind SGLang's router on GPUs, one CPU engine server
on a CPU machine, or an engine already running at a given address."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EngineConfig:
    model_path: str  # HF folder the engines load (weights, tokenizer)
    engine_url: str | None = None  # use this running engine instead of starting any
    num_gpus: int = 0  # SGLang engines on this many GPUs; 0: the CPU engine server
    gpus_per_engine: int = 1
    mem_fraction_static: float = 0.8
    router_port: int = 0  # 0: a free port
    memory_saver: bool = False  # colocated: SGLang's memory saver, so the engines can hand memory to the trainer
    cpu_max_batch_size: int = 32  # CPU engine: sequences decoded together
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.num_gpus < 0 or self.gpus_per_engine <= 0 or self.num_gpus % self.gpus_per_engine:
            raise ValueError(
                f"--rollout-num-gpus {self.num_gpus} is not a multiple of --rollout-num-gpus-per-engine "
                f"{self.gpus_per_engine}"
            )

    @property
    def ranks_per_engine(self) -> int:
        """Process-group ranks (GPUs) of one engine; the CPU engine (or a given one) is one rank."""
        return self.gpus_per_engine if self.num_gpus else 1


@dataclass
class Engines:
    url: str  # where /generate goes: the one engine, or the router in front of several
    worker_urls: list[str]  # every engine, for weight updates and memory hand-over
    processes: list[Any] = field(default_factory=list)

    def stop(self) -> None:
        for process in self.processes:
            process.stop()


def start_engines(config: EngineConfig, log_dir: Path, gpu_ids: list[str] | None = None) -> Engines:
    """SGLang engines + router on the GPUs Ray gave this process or, colocated, on the actor's GPUs (`gpu_ids`, in
    actor rank order); else one CPU engine; or nothing, when `config.engine_url` names a running engine."""
    from slime_search.utils.net import free_port
    from slime_search.utils.server_process import ServerProcess

    if config.engine_url:
        return Engines(config.engine_url, [config.engine_url])
    if config.num_gpus:
        from slime_search.engines import sglang_launch

        specs = sglang_launch.engine_specs(
            config.model_path,
            config.num_gpus,
            config.gpus_per_engine,
            first_port=free_port(),
            mem_fraction_static=config.mem_fraction_static,
            extra_args=("--enable-memory-saver",) if config.memory_saver else (),
        )
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpu_ids))} if gpu_ids else None
        deployment = sglang_launch.launch(specs, "127.0.0.1", config.router_port, env=env)
        return Engines(deployment.router_url, [s.url for s in specs], [deployment])
    command = ["-m", "slime_search.engines.cpu_engine_server", "--model-path", config.model_path, "--port", "0"]
    command += ["--max-batch-size", str(config.cpu_max_batch_size), "--seed", str(config.seed), "--weight-version", "0"]
    engine = ServerProcess(command, log_path=Path(log_dir) / "engine.log")
    return Engines(engine.url, [engine.url], [engine])
