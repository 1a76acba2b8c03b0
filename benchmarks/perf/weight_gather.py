"""Trainer memory of preparing a weight push: the whole model gathered at once vs streamed unit by unit.

    python -m benchmarks.perf.weight_gather                   # a random Megatron model of Qwen2.5-0.5B's shape
    python -m benchmarks.perf.weight_gather --hidden-size 256 --num-layers 4

Each way runs in a fresh process holding a Megatron model (TP 1, CPU, fp32) and goes through every HF-named tensor
the way a push does, keeping the current bucket until the next one is drawn:
* whole: gather every shard, rename the whole model, cut it into buckets (a second copy of the model);
* streamed: `iter_hf_buckets`, which gathers and renames one unit (embedding, decoder layer, head) at a time.
Prints the extra resident memory at the peak (sampled every 2 ms) and the time taken. On GPU the same difference
is device memory, the scarce kind when engines share the trainer's GPUs.

Its figures: `docs/benchmarks/weight_sync.md`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

PAGE = 4096


def resident_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * PAGE


class PeakSampler:
    """The highest resident memory seen while the `with` block runs."""

    def __enter__(self):
        self.peak, self._stop = resident_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, resident_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())


def hf_buckets(mode: str, state: dict, shape, bucket_bytes: int):
    from megatron_bridge import iter_buckets, megatron_to_hf_part
    from slime_search.weight_sync.gather import gather_full_megatron_state, iter_hf_buckets

    if mode == "streamed":
        return iter_hf_buckets(state, shape, False, bucket_bytes)
    hf = megatron_to_hf_part(gather_full_megatron_state(state), shape)
    return iter_buckets(((name, tensor.contiguous()) for name, tensor in hf.items()), bucket_bytes)


def measure(mode: str, args) -> dict:
    """One way, in this process: the model, then every bucket drawn and held until the next."""
    import gc

    from megatron_bridge import ModelShape
    from slime_search.backends.megatron.distributed import init_megatron, shutdown
    from slime_search.backends.megatron.model import ModelOptions, build_gpt_model
    from slime_search.utils.net import free_port

    init_megatron(0, 1, tp_size=1, master_port=free_port())
    shape = ModelShape(
        args.num_layers, args.hidden_size, args.num_heads, args.num_kv_heads, args.intermediate_size, 151936, True
    )
    model = build_gpt_model(shape, ModelOptions())
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    gc.collect()
    before = resident_bytes()
    started = time.perf_counter()
    buckets = 0
    with PeakSampler() as sampler:
        held = None
        for bucket in hf_buckets(mode, state, shape, args.bucket_mb * 1024**2):
            held = bucket  # a push keeps a bucket until the engines have it
            buckets += 1
        del held
    seconds = time.perf_counter() - started
    shutdown()
    return {
        "mode": mode,
        "model_gib": model_bytes / 2**30,
        "extra_peak_gib": (sampler.peak - before) / 2**30,
        "buckets": buckets,
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    from benchmarks.harness.model_shape import add_shape_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(parser)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--only", choices=["whole", "streamed"], help="measure one way here (used internally)")
    args = parser.parse_args(argv)
    if args.only:
        print(json.dumps(measure(args.only, args)))
        return 0
    print(f"{'way':<10} {'model GiB':>10} {'extra peak GiB':>15} {'buckets':>8} {'s':>7}")
    for mode in ("whole", "streamed"):
        child = [sys.executable, "-m", "benchmarks.perf.weight_gather", *(argv or sys.argv[1:]), "--only", mode]
        result = json.loads(subprocess.run(child, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        print(
            f"{mode:<10} {result['model_gib']:>10.2f} {result['extra_peak_gib']:>15.2f} "
            f"{result['buckets']:>8} {result['seconds']:>7.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
