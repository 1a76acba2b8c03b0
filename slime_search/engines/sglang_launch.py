"""Launch SGLang engines (one `sglang.launch_server` per engine) and the SGLang router.

SGLang is imported by the child processes only; building commands and registering workers need no GPU. Each engine
serves SGLang's native API on its own port; the router spreads /generate over the engines, and the control calls (weight
updates, memory hand-over, abort) go to each engine's own address, since the router does not route them. Engines start
together (all spawned, then all awaited). The router runs without its own health checks and circuit breaker. SGLang's
/health is a real one-token generation. An engine that has released its memory to a colocated trainer must not run one.
And while a weight update holds the engine, it takes longer than the router's 5 s probe. Worker registration (`POST
/workers`) is asynchronous in the router, so `launch` waits until every engine is listed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import httpx

from slime_search.utils.server_process import ServerProcess

logger = logging.getLogger(__name__)

# Engines that hand their memory to a colocated trainer (SGLang's memory saver), as SGLang 0.5.23 needs them:
# - CUDA graphs are captured into memory the saver can release only with SGLANG_MEMORY_SAVER_CUDA_GRAPH=1
#   (runner_backend/full_cuda_graph_backend.py); without it the "cuda_graph" tag releases nothing and the graphs stay
#   on the GPU through training;
# - with it, the breakable prefill graph (the default on CUDA) refuses the saver (NotImplementedError in
#   breakable_cuda_graph_backend.py), so prefill runs without a graph; decode keeps its full graph;
# - the saver's allocator does not take PyTorch's expandable segments, so the allocator settings are not passed on.
MEMORY_SAVER_ARGS = ("--enable-memory-saver", "--cuda-graph-backend-prefill", "disabled")
MEMORY_SAVER_ENV = {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}
MEMORY_SAVER_UNSET_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@dataclass(frozen=True)
class SGLangEngineSpec:
    model_path: str
    port: int
    tp_size: int = 1
    base_gpu_id: int = 0
    mem_fraction_static: float = 0.8
    host: str = "127.0.0.1"
    weight_version: str = "0"  # served before the first update (SGLang's own default is "default")
    random_seed: int | None = None  # SGLang's --random-seed (its default: a random one)
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--tp-size",
            str(self.tp_size),
            "--base-gpu-id",
            str(self.base_gpu_id),
            "--mem-fraction-static",
            str(self.mem_fraction_static),
            "--weight-version",
            self.weight_version,
            *(["--random-seed", str(self.random_seed)] if self.random_seed is not None else []),
            *self.extra_args,
        ]


def engine_specs(
    model_path: str,
    num_gpus: int,
    gpus_per_engine: int,
    first_port: int,
    mem_fraction_static: float = 0.8,
    host: str = "127.0.0.1",
    first_gpu: int = 0,
    extra_args: tuple[str, ...] = (),
    seed: int | None = None,
) -> list[SGLangEngineSpec]:
    """`--rollout-num-gpus` split into engines of `--rollout-num-gpus-per-engine` GPUs each; engine i is seeded with
    `seed + i` (--seed), so that the engines draw different samples for the same prompt."""
    if gpus_per_engine <= 0 or num_gpus % gpus_per_engine:
        raise ValueError(
            f"--rollout-num-gpus {num_gpus} is not a multiple of --rollout-num-gpus-per-engine {gpus_per_engine}"
        )
    return [
        SGLangEngineSpec(
            model_path=model_path,
            port=first_port + i,
            tp_size=gpus_per_engine,
            base_gpu_id=first_gpu + i * gpus_per_engine,
            mem_fraction_static=mem_fraction_static,
            host=host,
            random_seed=None if seed is None else seed + i,
            extra_args=tuple(extra_args),
        )
        for i in range(num_gpus // gpus_per_engine)
    ]


def router_command(host: str, port: int, metrics_port: int) -> list[str]:
    """The router's metrics on a port of their own on `host`.

    The router's default is 29000 on every interface. The first router on a machine takes it. A second one (another
    run, or this one's restarted) would then exit at start.
    """
    return [
        "-m",
        "sglang_router.launch_router",
        "--host",
        host,
        "--port",
        str(port),
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(metrics_port),
        "--disable-health-check",
        "--disable-circuit-breaker",
    ]


def register_worker(router_url: str, worker_url: str, timeout_s: float = 30.0) -> None:
    """Add an engine to the router (`POST /workers`, which the router answers 202 and carries out later)."""
    response = httpx.post(
        f"{router_url}/workers", json={"url": worker_url, "worker_type": "regular"}, timeout=timeout_s
    )
    if response.status_code >= 400:
        raise RuntimeError(
            f"router {router_url} refused worker {worker_url}: HTTP {response.status_code} {response.text[:200]}"
        )


def registered_workers(router_url: str) -> set[str]:
    """The engines the router sends requests to (listed and healthy)."""
    listing = httpx.get(f"{router_url}/workers", timeout=10).json()
    return {worker["url"] for worker in listing.get("workers", []) if worker.get("is_healthy", False)}


def wait_registered(router_url: str, worker_urls: list[str], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        missing = set(worker_urls) - registered_workers(router_url)
        if not missing:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"router {router_url} never listed the engines {sorted(missing)}")
        time.sleep(0.2)


def worker_ids(router_url: str) -> dict[str, str]:
    """The router's id of every engine it lists (its DELETE takes the id, not the address)."""
    listing = httpx.get(f"{router_url}/workers", timeout=10).json()
    return {worker["url"]: worker["id"] for worker in listing.get("workers", [])}


def remove_worker(router_url: str, worker_url: str) -> None:
    """Take an engine out of the router's rotation (a dead engine would otherwise get requests, each answered 500)."""
    worker_id = worker_ids(router_url).get(worker_url)
    if worker_id is None:
        return
    response = httpx.delete(f"{router_url}/workers/{worker_id}", timeout=30)
    if response.status_code >= 400:
        raise RuntimeError(f"router {router_url} kept worker {worker_url}: HTTP {response.status_code} {response.text}")


def engine_process(
    spec: SGLangEngineSpec,
    timeout_s: float = 900.0,
    env: dict[str, str] | None = None,
    python: str | None = None,
    log_path=None,
    unset_env: tuple[str, ...] = (),
) -> ServerProcess:
    """One engine on its own address, started and not waited for: `wait_ready()` returns once /health_generate (a
    real one-token generation) answers."""
    return ServerProcess(
        spec.command(),
        health_path="/health_generate",
        timeout=timeout_s,
        url=spec.url,
        env=env,
        python=python,
        wait=False,
        log_path=log_path,
        unset_env=unset_env,
    )


def start_router(host: str, port: int, env: dict[str, str] | None = None, python: str | None = None) -> ServerProcess:
    """The router on `port` (a free one when 0: picked only now, since starting engines take ports of their own), its
    metrics on another free one."""
    from slime_search.utils.net import free_port

    port = port or free_port()
    url = f"http://{host}:{port}"
    command = router_command(host, port, metrics_port=free_port())
    return ServerProcess(command, health_path="/health", timeout=120, url=url, env=env, python=python)


def register_all(router: ServerProcess, worker_urls: list[str]) -> None:
    for url in worker_urls:
        register_worker(router.url, url)
    wait_registered(router.url, worker_urls)


@dataclass
class SGLangDeployment:
    router_url: str
    engines: list[ServerProcess]
    router: ServerProcess
    specs: list[SGLangEngineSpec] = field(default_factory=list)
    env: dict[str, str] | None = None
    python: str | None = None
    timeout_s: float = 900.0
    unset_env: tuple[str, ...] = ()

    def start_engine(self, index: int) -> ServerProcess:
        """Engine `index` started again on its own address (not waited for)."""
        return engine_process(self.specs[index], self.timeout_s, self.env, self.python, unset_env=self.unset_env)

    def stop(self) -> None:
        self.router.stop()
        for engine in self.engines:
            engine.stop()


def check_installed(python: str | None) -> None:
    if python is None:
        import importlib.util

        if importlib.util.find_spec("sglang") is None:
            raise RuntimeError("SGLang is not installed: see docs/gpu.md for the pinned GPU install")


def launch(
    specs: list[SGLangEngineSpec],
    router_host: str,
    router_port: int,
    timeout_s: float = 900.0,
    env: dict[str, str] | None = None,
    python: str | None = None,
    unset_env: tuple[str, ...] = (),
) -> SGLangDeployment:
    """Start every engine, wait until all answer /health_generate, start the router (on a free port when `router_port`
    is 0) and register the engines with it. Every process gets `env` added to its environment and runs under `python`
    (this interpreter by default); the engines' environment lacks the variables of `unset_env`."""
    check_installed(python)
    engines: list[ServerProcess] = []
    try:
        for spec in specs:
            engines.append(engine_process(spec, timeout_s, env, python, unset_env=unset_env))
        for engine in engines:
            engine.wait_ready()
        router = start_router(router_host, router_port, env, python)
        try:
            register_all(router, [spec.url for spec in specs])
        except BaseException:
            router.stop()
            raise
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    logger.info("SGLang router at %s with %d engines", router.url, len(specs))
    return SGLangDeployment(router.url, engines, router, list(specs), env, python, timeout_s, unset_env)
