"""Build a retrieval index over a `{"id","contents"}` jsonl corpus: faiss over encoder embeddings, or BM25.

Dense (e5 as in Search-R1; any Hugging Face encoder path works):
    python local_dense_retriever/build_index.py --retriever-name e5 --retriever-model intfloat/e5-base-v2 \
        --corpus-path wiki-18.jsonl --save-dir indexes --faiss-type Flat [--fp16]
BM25 (no model weights):
    python local_dense_retriever/build_index.py --retriever-name bm25 --corpus-path wiki-18.jsonl --save-dir indexes

Embeddings are written to SAVE_DIR/embeddings/ in shards, so memory stays bounded and an interrupted build
resumes where it stopped (rerun the same command). The index file is SAVE_DIR/<name>_<factory>.index, with a
.meta.json beside it that the server reads to pick the same encoder settings.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from local_dense_retriever.corpus import Corpus  # noqa: E402
from local_dense_retriever.encoder import Encoder, EncoderConfig  # noqa: E402
from local_dense_retriever.index import apply_fp16, encoder_meta, index_filename, write_meta  # noqa: E402

logger = logging.getLogger(__name__)
MAX_TRAIN_VECTORS = 1_000_000


def embed_shards(corpus: Corpus, encoder: Encoder, shard_dir: Path, shard_size: int) -> list[Path]:
    """Encode the corpus shard by shard; shards already on disk are kept (resume)."""
    from tqdm import tqdm

    shard_dir.mkdir(parents=True, exist_ok=True)
    shards = []
    progress = tqdm(total=len(corpus), desc="embedding", unit="doc")
    for number, start in enumerate(range(0, len(corpus), shard_size)):
        path = shard_dir / f"shard_{number:05d}_{start}_{min(start + shard_size, len(corpus))}.npy"
        if not path.is_file():
            texts = list(corpus.iter_contents(start, start + shard_size))
            vectors = encoder.encode(texts, is_query=False)
            tmp = path.with_name(path.name + ".tmp.npy")
            np.save(tmp, vectors)
            tmp.replace(path)  # a shard is either complete or absent
        shards.append(path)
        progress.update(min(shard_size, len(corpus) - start))
    progress.close()
    return shards


def build_faiss(shards: list[Path], dim: int, factory: str):
    import faiss

    index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:
        # An even slice of every shard, read through mmap: never the whole corpus in memory at once.
        per_shard = -(-MAX_TRAIN_VECTORS // len(shards))
        sample = np.concatenate([np.load(p, mmap_mode="r")[:per_shard] for p in shards])
        logger.info("training %s on %d vectors", factory, len(sample))
        index.train(np.ascontiguousarray(sample, dtype=np.float32))
    for path in shards:
        index.add(np.ascontiguousarray(np.load(path), dtype=np.float32))
    return index


def build_dense(args: argparse.Namespace) -> Path:
    import faiss

    factory = apply_fp16(args.faiss_type) if args.fp16 else args.faiss_type
    save_dir = Path(args.save_dir)
    corpus = Corpus(args.corpus_path)
    config = EncoderConfig(
        model_path=args.retriever_model,
        family=args.family,
        pooling=args.pooling,
        max_length=args.max_length,
        batch_size=args.batch_size,
        fp16=args.fp16,
    )
    encoder = Encoder(config)
    shards = embed_shards(corpus, encoder, save_dir / "embeddings" / args.retriever_name, args.shard_size)
    index = build_faiss(shards, encoder.dim, factory)
    out = save_dir / index_filename(args.retriever_name, factory)
    faiss.write_index(index, str(out))
    write_meta(
        out,
        {
            "retriever_name": args.retriever_name,
            "factory": factory,
            "dim": encoder.dim,
            "num_docs": len(corpus),
            "corpus_path": str(Path(args.corpus_path).resolve()),
            "encoder": encoder_meta(config),
        },
    )
    return out


def build_bm25(args: argparse.Namespace) -> Path:
    import bm25s

    corpus = Corpus(args.corpus_path)
    tokens = bm25s.tokenize(list(corpus.iter_contents()), stopwords="en", show_progress=True)
    model = bm25s.BM25()
    model.index(tokens, show_progress=True)
    out = Path(args.save_dir) / "bm25"
    model.save(str(out))
    (out / "bm25_meta.json").write_text(
        json.dumps({"stopwords": "en", "num_docs": len(corpus), "corpus_path": str(Path(args.corpus_path).resolve())})
    )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus-path", "--corpus_path", required=True)
    parser.add_argument("--save-dir", "--save_dir", required=True)
    parser.add_argument("--retriever-name", "--retriever_name", default="e5", help="e5, bge, bm25, or any label")
    parser.add_argument("--retriever-model", "--retriever_model", help="encoder path or hub name (dense only)")
    parser.add_argument(
        "--faiss-type", "--faiss_type", default="Flat", help="faiss factory: Flat, HNSW64, IVF4096,PQ64"
    )
    parser.add_argument("--fp16", action="store_true", help="store vectors in fp16 (and encode in fp16 on GPU)")
    parser.add_argument("--family", default="auto", choices=["auto", "e5", "bge", "plain"])
    parser.add_argument("--pooling", default="auto", choices=["auto", "mean", "cls"])
    parser.add_argument("--max-length", "--max_length", type=int, default=256)
    parser.add_argument("--batch-size", "--batch_size", type=int, default=64, help="encoder batch (raise on GPU)")
    parser.add_argument("--shard-size", type=int, default=100_000, help="passages per embedding shard on disk")
    args = parser.parse_args(argv)
    if args.retriever_name != "bm25" and not args.retriever_model:
        parser.error("--retriever-model is required for a dense index")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    try:
        out = build_bm25(args) if args.retriever_name == "bm25" else build_dense(args)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    logger.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
