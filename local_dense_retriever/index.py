"""Retrievers behind the server: a faiss index over encoder embeddings, or BM25. Both return row numbers."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

import numpy as np

from local_dense_retriever.encoder import Encoder, EncoderConfig

logger = logging.getLogger(__name__)


def apply_fp16(factory: str) -> str:
    """Store vectors as fp16 (faiss scalar quantizer): half the memory of Flat at nearly identical recall."""
    if factory == "Flat":
        return "SQfp16"
    if factory.startswith("IVF") and factory.endswith(",Flat"):
        return factory[: -len("Flat")] + "SQfp16"
    raise ValueError(f"fp16 storage applies to 'Flat' or 'IVF<n>,Flat' factories, not {factory!r}")


def index_filename(retriever_name: str, factory: str) -> str:
    return f"{retriever_name}_{factory.replace(',', '_')}.index"


def meta_path(index_path: Path) -> Path:
    return index_path.with_suffix(".meta.json")


def write_meta(index_path: Path, meta: dict) -> None:
    meta_path(index_path).write_text(json.dumps(meta, indent=2))


def read_meta(index_path: Path) -> dict:
    path = meta_path(index_path)
    return json.loads(path.read_text()) if path.is_file() else {}


class DenseRetriever:
    """faiss inner-product search over L2-normalised embeddings. Not thread-safe: one owner thread calls it."""

    def __init__(
        self,
        index_path: str | Path,
        encoder_config: EncoderConfig,
        faiss_gpu: bool = False,
        runtime: str = "torch",
        threads: int = 0,
        search_params: str = "auto",
    ):
        import faiss

        index_path = Path(index_path)
        if not index_path.is_file():
            raise FileNotFoundError(f"faiss index not found: {index_path}")
        self.index = faiss.read_index(str(index_path))
        self.index_type = read_meta(index_path).get("factory", type(self.index).__name__)
        self.search_params = search_params_for(self.index) if search_params == "auto" else search_params
        if faiss_gpu:
            self.index = to_all_gpus(self.index, fp16=encoder_config.fp16)
        if self.search_params:
            space = faiss.GpuParameterSpace() if faiss_gpu else faiss.ParameterSpace()
            space.set_index_parameters(self.index, self.search_params)  # an unknown name raises, naming it
        self.encoder = Encoder(encoder_config, runtime=runtime, threads=threads)
        if self.encoder.dim != self.index.d:
            raise ValueError(
                f"encoder {encoder_config.model_path} gives {self.encoder.dim}-d vectors but the index holds "
                f"{self.index.d}-d vectors: use the encoder the index was built with"
            )
        self.size = int(self.index.ntotal)
        self.name = encoder_config.model_path

    def search(self, queries: list[str], topk: int) -> tuple[np.ndarray, np.ndarray]:
        embeddings = self.encoder.encode(queries, is_query=True)
        scores, rows = self.index.search(embeddings, topk)
        return rows, scores


# Approximate indexes search as wide as these by default: faiss saves nprobe 1 (IVF) and efSearch 16 (HNSW) in a new
# index's file, which over 2M wiki-18-like vectors found 0.18 and 0.30 of the exact top 3; nprobe 64 found 0.95 and
# efSearch 128 0.71 there (docs/benchmarks/retrieval.md, "At wiki-18's size"). A file's own wider setting is kept.
WIDE_SEARCH = {"nprobe": 64, "efSearch": 128}


def search_params_for(index) -> str:
    """The faiss search parameters to serve `index` with: WIDE_SEARCH for what it has, unless its file set wider."""
    import faiss

    params = []
    if _has_ivf(index) and faiss.extract_index_ivf(index).nprobe < WIDE_SEARCH["nprobe"]:
        params.append(f"nprobe={WIDE_SEARCH['nprobe']}")
    hnsw = getattr(faiss.downcast_index(index), "hnsw", None)
    if hnsw is not None and hnsw.efSearch < WIDE_SEARCH["efSearch"]:
        params.append(f"efSearch={WIDE_SEARCH['efSearch']}")
    return ",".join(params)


def _has_ivf(index) -> bool:
    import faiss

    try:
        faiss.extract_index_ivf(index)
    except RuntimeError:  # not an IVF index, nor one wrapping it
        return False
    return True


def to_all_gpus(index, fp16: bool):
    """Shard the index over every visible GPU (faiss GPU indexes are then used from one thread only)."""
    import faiss

    options = faiss.GpuMultipleClonerOptions()
    options.shard = True
    options.useFloat16 = fp16
    return faiss.index_cpu_to_all_gpus(index, co=options)


class BM25Retriever:
    """Okapi BM25 (bm25s) over the same corpus rows; no model weights."""

    def __init__(self, index_dir: str | Path):
        import bm25s

        index_dir = Path(index_dir)
        if not (index_dir / "params.index.json").is_file():
            raise FileNotFoundError(f"no BM25 index in {index_dir} (expected params.index.json)")
        self.model = bm25s.BM25.load(str(index_dir), mmap=True)
        meta = (
            json.loads((index_dir / "bm25_meta.json").read_text()) if (index_dir / "bm25_meta.json").is_file() else {}
        )
        self.stopwords = meta.get("stopwords", "en")
        self.size = int(self.model.scores["num_docs"])
        self.index_type = "bm25"
        self.name = "bm25"

    def search(self, queries: list[str], topk: int) -> tuple[np.ndarray, np.ndarray]:
        import bm25s

        tokens = bm25s.tokenize(queries, stopwords=self.stopwords, show_progress=False)
        k = min(topk, self.size)
        rows, scores = self.model.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        if k < topk:  # pad like faiss does when fewer documents exist than asked for
            rows = np.pad(rows, ((0, 0), (0, topk - k)), constant_values=-1)
            scores = np.pad(scores, ((0, 0), (0, topk - k)), constant_values=0)
        return rows.astype(np.int64), scores.astype(np.float32)


# Settings of how the index was built that a server must reuse; batch size and fp16 are choices of the runtime.
_MODEL_FIELDS = ("model_path", "family", "pooling", "max_length")


def encoder_config_from_meta(meta: dict, **overrides) -> EncoderConfig:
    fields = {k: v for k, v in meta.get("encoder", {}).items() if k in _MODEL_FIELDS}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return EncoderConfig(**fields)


def encoder_meta(config: EncoderConfig) -> dict:
    meta = asdict(config)
    meta["family"], meta["pooling"] = config.resolved_family(), config.resolved_pooling()
    return meta
