"""Which engines serve a run, starting them, and starting again one that died.

The engines are SGLang engines behind SGLang's router on GPUs, CPU engine servers on a CPU machine, or an engine
already running at a given address.

An engine that has exited or does not answer a one-token generation in time is found by `find_down`. It is started
again on its own address (`restart`, then `wait_restarted`). It serves the checkpoint it was started from until the
next weight push. The driver makes that push before the engine gets any request. While it is down, the router (when
there is one) has it taken out of its rotation, and it is registered again once back. An engine given by address is
never restarted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slime_search.config.engines import EngineConfig

logger = logging.getLogger(__name__)


@dataclass
class EngineSlot:
    """One engine this run started, and how to start it again on the same address."""

    url: str
    start: Callable[[], Any]  # -> ServerProcess, started without waiting for it
    process: Any  # ServerProcess


@dataclass
class Engines:
    url: str  # one address for /generate: the router in front of several engines, or the one engine
    worker_urls: list[str]  # every engine, for generation, weight updates and memory hand-over
    slots: dict[str, EngineSlot] = field(default_factory=dict)  # the engines this run started
    router: Any = None  # ServerProcess of the SGLang router, if any
    health_timeout_s: float = 60.0
    restarting: list[str] = field(default_factory=list)

    def find_down(self) -> list[str]:
        """The engines this run started that have exited or fail a one-token generation within the health timeout."""
        from slime_search.engines.client import EngineClient, EngineClientConfig, EngineError

        async def healthy(url: str) -> bool:
            if self.slots[url].process.proc.poll() is not None:
                return False
            client = EngineClient(EngineClientConfig(url, timeout_s=self.health_timeout_s, connect_timeout_s=5.0))
            try:
                await client.health_generate()
                return True
            except EngineError as err:
                logger.warning("engine %s failed its health check: %s", url, err)
                return False
            finally:
                await client.close()

        async def check_all() -> list[bool]:
            return list(await asyncio.gather(*(healthy(url) for url in self.slots)))

        return [url for url, ok in zip(self.slots, asyncio.run(check_all()), strict=True) if not ok]

    def restart(self, urls: list[str]) -> None:
        """Stop what is left of these engines and start them again on their own addresses (not waited for)."""
        for url in urls:
            if url not in self.slots:
                raise ValueError(f"{url} is not an engine this run started")
            if self.router is not None:
                from slime_search.engines.sglang_launch import remove_worker

                remove_worker(self.router.url, url)
            slot = self.slots[url]
            slot.process.stop()  # our own child: a frozen engine is killed, an exited one reaped
            slot.process = slot.start()
            self.restarting.append(url)
            logger.warning("engine %s restarted", url)

    def wait_restarted(self) -> list[str]:
        """Wait until every restarted engine is ready (and listed by the router again); returns their addresses."""
        back, self.restarting = self.restarting, []
        for url in back:
            self.slots[url].process.wait_ready()
        if back and self.router is not None:
            from slime_search.engines.sglang_launch import register_all

            register_all(self.router, back)
        return back

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for slot in self.slots.values():
            slot.process.stop()


def cpu_engine_command(config: EngineConfig, port: int, index: int) -> list[str]:
    command = ["-m", "slime_search.engines.cpu_engine_server", "--model-path", config.model_path, "--port", str(port)]
    seed = config.seed + index  # engines draw different samples for the same prompt
    command += ["--max-batch-size", str(config.cpu_max_batch_size), "--seed", str(seed), "--weight-version", "0"]
    return command + list(config.cpu_engine_args)


def start_cpu_engines(config: EngineConfig, log_dir: Path) -> Engines:
    """`config.cpu_engines` CPU engine servers, started together; each restarts on the port it first got."""
    from slime_search.utils.server_process import ServerProcess

    def log(index: int) -> Path:
        return Path(log_dir) / ("engine.log" if config.cpu_engines == 1 else f"engine-{index}.log")

    first = [
        ServerProcess(cpu_engine_command(config, 0, i), log_path=log(i), wait=False) for i in range(config.cpu_engines)
    ]
    try:
        for process in first:
            process.wait_ready()
    except BaseException:
        for process in first:
            process.stop()
        raise
    slots = {}
    for index, process in enumerate(first):
        port = int(process.url.rsplit(":", 1)[1])
        restarts = iter(range(1, 1 << 30))

        def start(index=index, port=port, restarts=restarts):  # a log of its own: the dead engine's log stays
            restarted_log = log(index).with_suffix(f".restart{next(restarts)}.log")
            return ServerProcess(cpu_engine_command(config, port, index), log_path=restarted_log, wait=False)

        slots[process.url] = EngineSlot(process.url, start, process)
    urls = list(slots)
    return Engines(urls[0], urls, slots, health_timeout_s=config.health_timeout_s)


def sglang_environment(config: EngineConfig, gpu_ids: list[str] | None) -> tuple[dict[str, str], tuple[str, ...]]:
    """What the SGLang engines' environment gets and loses: their GPUs when given (colocated: the actor's), and with
    the memory saver what it needs (sglang_launch.MEMORY_SAVER_ENV, MEMORY_SAVER_UNSET_ENV)."""
    from slime_search.engines import sglang_launch

    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpu_ids))} if gpu_ids else {}
    if not config.memory_saver:
        return env, ()
    return {**env, **sglang_launch.MEMORY_SAVER_ENV}, sglang_launch.MEMORY_SAVER_UNSET_ENV


def start_sglang_engines(config: EngineConfig, gpu_ids: list[str] | None) -> Engines:
    from slime_search.engines import sglang_launch
    from slime_search.utils.net import free_port

    specs = sglang_launch.engine_specs(
        config.model_path,
        config.num_gpus,
        config.gpus_per_engine,
        first_port=free_port(),
        mem_fraction_static=config.mem_fraction_static,
        extra_args=(*(sglang_launch.MEMORY_SAVER_ARGS if config.memory_saver else ()), *config.lora_args),
        seed=config.seed,
    )
    env, unset_env = sglang_environment(config, gpu_ids)
    deployment = sglang_launch.launch(specs, "127.0.0.1", config.router_port, env=env, unset_env=unset_env)
    slots = {
        spec.url: EngineSlot(spec.url, lambda i=i: deployment.start_engine(i), process)
        for i, (spec, process) in enumerate(zip(specs, deployment.engines, strict=True))
    }
    return Engines(deployment.router_url, list(slots), slots, deployment.router, config.health_timeout_s)


def start_engines(config: EngineConfig, log_dir: Path, gpu_ids: list[str] | None = None) -> Engines:
    """SGLang engines + router on the GPUs Ray gave this process or, colocated, on the actor's GPUs (`gpu_ids`, in
    actor rank order); else CPU engine servers; or nothing, when `config.engine_url` names running engines."""
    if config.engine_url:
        urls = [url.strip() for url in config.engine_url.split(",") if url.strip()]
        return Engines(urls[0], urls)
    if config.num_gpus:
        return start_sglang_engines(config, gpu_ids)
    return start_cpu_engines(config, log_dir)
