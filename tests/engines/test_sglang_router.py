"""The real sglang-router in front of two real SGLang engines (on CPU), started by the project's launcher."""

import asyncio
import threading
import time

import httpx
import psutil
import pytest
import torch

from slime_search.engines.client import call_engine, on_every_engine
from slime_search.engines.sglang_launch import launch, registered_workers
from slime_search.utils.net import free_port
from tests import sglang_cpu

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_router_registers_both_engines_spreads_requests_and_flushes_them(tiny_checkpoint):
    python = sglang_cpu.python()
    # each engine serves its own weight version, so every answer says which engine produced it
    specs = [sglang_cpu.engine_spec(tiny_checkpoint, free_port(), weight_version=v) for v in ("a", "b")]
    deployment = launch(
        specs, "127.0.0.1", 0, timeout_s=sglang_cpu.START_TIMEOUT_S, env=sglang_cpu.CPU_ENV, python=python
    )
    router = deployment.router_url
    try:
        # the engines were started together, not one after the other (each takes tens of seconds to come up)
        started = [psutil.Process(engine.proc.pid).create_time() for engine in deployment.engines]
        assert abs(started[0] - started[1]) < 10
        # the router registers workers in the background; launch returned only once both were listed
        assert registered_workers(router) == {spec.url for spec in specs}

        def generate(index: int, **extra) -> dict:
            # prompts with nothing in common: the router's cache-aware policy sends a shared prefix to one engine
            prompt = torch.randint(1000, 100000, (16,), generator=torch.Generator().manual_seed(index)).tolist()
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, **extra}, "return_logprob": True}
            response = httpx.post(f"{router}/generate", json=body, timeout=300)
            assert response.status_code == 200, response.text
            return response.json()

        served = []
        threads = [threading.Thread(target=lambda i=i: served.append(generate(i))) for i in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert {out["meta_info"]["weight_version"] for out in served} == {"a", "b"}

        flushed = httpx.post(f"{router}/flush_cache", timeout=60)  # the router fans a flush out to every engine
        assert flushed.status_code == 200 and flushed.json()["workers_flushed"] == 2

        # the router does not route aborts (404): they go to every engine's own address
        assert httpx.post(f"{router}/abort_request", json={"abort_all": True}, timeout=60).status_code == 404
        result = {}
        running = threading.Thread(
            target=lambda: result.update(out=generate(99, max_new_tokens=3000, ignore_eos=True, temperature=1.0))
        )
        running.start()
        time.sleep(3)
        urls = [spec.url for spec in specs]
        asyncio.run(on_every_engine(urls, lambda url: call_engine(url, "abort")))
        running.join(timeout=300)
        assert result["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    finally:
        deployment.stop()


def test_a_dead_engine_leaves_the_router_and_returns_to_it_once_restarted(tiny_checkpoint, tmp_path):
    """The real router in front of two CPU engine servers (which it takes as SGLang workers). Killed, the engine the
    router's cache-aware policy sends a prompt to gets that prompt answered 500; restarting it takes it out of the
    router's rotation while it comes back, and registers it again."""
    from slime_search.engines.deployment import EngineConfig, Engines, start_engines
    from slime_search.engines.sglang_launch import register_all, start_router, worker_ids
    from slime_search.weight_sync.disk import update_engines_from_disk

    python = sglang_cpu.python()
    cpu = start_engines(EngineConfig(str(tiny_checkpoint), cpu_engines=2, health_timeout_s=10), tmp_path)
    router = start_router("127.0.0.1", 0, env={"PYTHONPATH": str(sglang_cpu.SHIMS)}, python=python)
    engines = Engines(router.url, cpu.worker_urls, cpu.slots, router, health_timeout_s=10)
    try:
        register_all(router, engines.worker_urls)
        for url, version in zip(engines.worker_urls, ("a", "b"), strict=True):  # an answer names its engine
            asyncio.run(update_engines_from_disk([url], str(tiny_checkpoint), version))

        def generate() -> httpx.Response:
            body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
            return httpx.post(f"{router.url}/generate", json=body, timeout=60)

        chosen = generate().json()["meta_info"]["weight_version"]
        victim = engines.worker_urls["ab".index(chosen)]
        engines.slots[victim].process.proc.kill()
        engines.slots[victim].process.proc.wait()
        assert generate().status_code == 500  # the router keeps the prompt on its engine, which is dead
        assert engines.find_down() == [victim]
        engines.restart([victim])
        assert victim not in worker_ids(router.url)  # out of the rotation while it starts
        assert engines.wait_restarted() == [victim]
        assert victim in registered_workers(router.url) and engines.find_down() == []
        assert generate().status_code == 200
    finally:
        engines.stop()


def test_two_routers_run_side_by_side_on_one_machine():
    """Two runs on one machine (or a router restarted while the old one's port lingers): the router's metrics
    default to port 29000 on every interface, where a second router exited at start."""
    from slime_search.engines.sglang_launch import start_router

    python = sglang_cpu.python()
    first = start_router("127.0.0.1", 0, env=sglang_cpu.CPU_ENV, python=python)
    try:
        second = start_router("127.0.0.1", 0, env=sglang_cpu.CPU_ENV, python=python)
        try:
            for router in (first, second):
                assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200
        finally:
            second.stop()
    finally:
        first.stop()
