"""Time one weight push to a running CPU engine server by each transport: disk, broadcast (gloo), tensor handles.

    python -m benchmarks.perf.weight_push                      # a random model of Qwen2.5-0.5B's shape, fp32
    python -m benchmarks.perf.weight_push --hidden-size 256 --num-layers 4 --repeats 5

The trainer side is this process holding the HF-named state (the Megatron gather and name conversion before a
push are the same for every transport and not timed); the disk-free pushes sit in SGLang's weight-update session,
as the transports' do. Each push is checked: the engine must serve its version.
Prints seconds per push (median of --repeats) and the effective bandwidth.

Its figures: `docs/benchmarks/weight_sync.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.harness.model_shape import add_shape_arguments


def model_state(args, folder: Path) -> dict:
    """A random model of the requested shape saved as the engine's checkpoint; its HF state as a trainer holds it."""
    from safetensors.torch import load_file

    from slime_search.models.tiny_qwen import TinyQwenConfig, save_tiny_checkpoint

    config = TinyQwenConfig(
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        intermediate_size=args.intermediate_size,
    )
    save_tiny_checkpoint(folder, config)
    return {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if k != "lm_head.weight"}


def push_by_disk(url: str, state: dict, original: Path, out: Path, version: str) -> None:
    from megatron_bridge.hf_io import save_hf_folder
    from slime_search.weight_sync.disk import update_engines_from_disk

    save_hf_folder(state, original, out)
    asyncio.run(update_engines_from_disk([url], str(out), version))


def push_by_handles(url: str, state: dict, bucket_bytes: int, version: str) -> None:
    from megatron_bridge import iter_buckets
    from slime_search.engines.weight_wire import serialize_named_tensors
    from slime_search.weight_sync.broadcast import with_last
    from slime_search.weight_sync.tensor_handles import post_bucket
    from slime_search.weight_sync.transport_base import weight_update_session

    with weight_update_session([url]):
        for bucket, last in with_last(iter_buckets(state.items(), bucket_bytes)):
            asyncio.run(post_bucket(url, [serialize_named_tensors(bucket)], version if last else None))


def timed(push, repeats: int, check) -> list[float]:
    times = []
    for r in range(repeats):
        started = time.perf_counter()
        version = push(r)
        times.append(time.perf_counter() - started)
        check(version)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    from slime_search.utils.net import free_port
    from slime_search.utils.server_process import ServerProcess
    from slime_search.weight_sync.broadcast import BroadcastConfig, WeightBroadcaster
    from slime_search.weight_sync.transport_base import served_versions, weight_update_session

    bucket_bytes = args.bucket_mb * 1024**2
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        state = model_state(args, folder)
        size = sum(t.numel() * t.element_size() for t in state.values())
        params = sum(t.numel() for t in state.values())
        print(f"model: {params / 1e6:.0f} M parameters, {size / 2**30:.2f} GiB fp32, {len(state)} tensors")
        argv_engine = ["-m", "slime_search.engines.cpu_engine_server", "--model-path", str(folder), "--port", "0"]
        with ServerProcess(argv_engine, timeout=600) as engine:

            def check(version: str) -> None:
                served = asyncio.run(served_versions([engine.url]))
                if served != [version]:
                    raise RuntimeError(f"engine serves {served}, expected {version}")

            results = {}
            results["disk"] = timed(
                lambda r: push_by_disk(engine.url, state, folder, Path(tmp) / f"step_{r}", f"d{r}") or f"d{r}",
                args.repeats,
                check,
            )
            started = time.perf_counter()
            broadcaster = WeightBroadcaster(BroadcastConfig("gloo", bucket_bytes=bucket_bytes))
            broadcaster.connect([engine.url], [1], "127.0.0.1", free_port())
            connect_s = time.perf_counter() - started
            try:

                def broadcast(r: int) -> str:
                    with weight_update_session([engine.url]):
                        return broadcaster.push(state, f"b{r}")[0]

                results["nccl (gloo)"] = timed(broadcast, args.repeats, check)
            finally:
                broadcaster.close()
            results["tensor (shared memory)"] = timed(
                lambda r: push_by_handles(engine.url, state, bucket_bytes, f"t{r}") or f"t{r}", args.repeats, check
            )
    print(f"broadcast group set-up (once per run): {connect_s:.2f} s")
    print(f"{'transport':<24} {'s / push (median)':>18} {'GiB/s':>7}   all pushes (s)")
    for name, times in results.items():
        median = statistics.median(times)
        print(f"{name:<24} {median:>18.2f} {size / 2**30 / median:>7.2f}   {', '.join(f'{t:.2f}' for t in times)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
