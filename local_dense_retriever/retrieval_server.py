"""Search-R1's `/retrieve` API over a local corpus, with micro-batching, a query cache and request validation.

    python local_dense_retriever/retrieval_server.py --index-path indexes/e5_Flat.index \
        --corpus-path wiki-18.jsonl --retriever-model intfloat/e5-base-v2 --topk 3 [--port 8000] [--faiss-gpu]
    python local_dense_retriever/retrieval_server.py --retriever-name bm25 --index-path indexes/bm25 \
        --corpus-path wiki-18.jsonl

POST /retrieve {"queries": [...], "topk": 3, "return_scores": false}   (or {"query": "..."}, SkyRL's form)
  -> {"result": [[{"id", "contents"}, ...] per query]}, or [{"document": {...}, "score": s}, ...] with scores.
GET /health -> readiness, corpus size, index type, encoder, queue depth, cache hit rate, repaired queries.

Every well-formed request is answered per query: an empty or blank query gets an empty list, an over-long one is
cut to --max-query-chars, one with unpaired surrogates has them replaced (both counted in /health), so one odd
query never fails its neighbours. A malformed request gets a 400 with a message, never a 5xx.
Binds 127.0.0.1 unless --host says otherwise.
"""

import argparse
import asyncio
import json
import logging
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from local_dense_retriever.batching import Hits, LRUCache, MicroBatcher, SearchFn, normalize_query  # noqa: E402
from slime_search.utils.net import listen_socket  # noqa: E402

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    default_topk: int = 3
    max_topk: int = 100
    max_queries: int = 16_384  # Search-R1 sends a whole GRPO batch in one request (512 x 5 = 2,560 queries)
    max_query_chars: int = 4096
    max_batch_size: int = 256
    max_wait_ms: float = 2.0
    cache_size: int = 100_000


class RequestError(ValueError):
    """A malformed request: answered with HTTP 400 and this message."""


@dataclass(frozen=True)
class RetrieveRequest:
    queries: list[str]  # as searched: cut to the length limit, unpaired surrogates replaced
    topk: int
    return_scores: bool
    truncated: int  # queries cut to the length limit
    repaired: int  # queries that held unpaired surrogates


def parse_body(raw: bytes) -> Any:
    """JSON, or a RequestError for anything the parser refuses: invalid text, nesting deeper than the parser
    recurses, an integer longer than Python converts."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        reason = "nested too deeply" if isinstance(err, RecursionError) else str(err)[:200]
        raise RequestError(f"body is not valid JSON: {reason}") from None


def _valid_text(query: str) -> str:
    """The query with unpaired surrogates (valid JSON escapes, not encodable text) replaced by U+FFFD."""
    return query.encode("utf-8", errors="surrogatepass").decode("utf-8", errors="replace")


def validate_request(body: Any, config: ServerConfig) -> RetrieveRequest:
    if not isinstance(body, dict):
        raise RequestError('body must be a JSON object like {"queries": ["..."], "topk": 3}')
    if "queries" not in body and isinstance(body.get("query"), str):
        queries = [body["query"]]  # SkyRL's single-query form; answered in the same shape, one list
    else:
        queries = body.get("queries")
    if not isinstance(queries, list) or not queries:
        raise RequestError("'queries' must be a non-empty list of strings (or 'query' one string)")
    if len(queries) > config.max_queries:
        raise RequestError(f"too many queries: {len(queries)} > {config.max_queries}; split the request")
    for i, query in enumerate(queries):
        if not isinstance(query, str):
            raise RequestError(f"queries[{i}] is a {type(query).__name__}, not a string")
    topk = body.get("topk")
    if topk is None:
        topk = config.default_topk
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= config.max_topk:
        raise RequestError(f"'topk' must be an integer in [1, {config.max_topk}], got {str(topk)[:40]!r}")
    return_scores = body.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise RequestError(f"'return_scores' must be true or false, got {str(return_scores)[:40]!r}")
    valid = [_valid_text(q) for q in queries]
    repaired = sum(v != q for v, q in zip(valid, queries, strict=True))
    truncated = sum(len(q) > config.max_query_chars for q in valid)
    searched = [q[: config.max_query_chars] for q in valid]
    return RetrieveRequest(searched, topk, return_scores, truncated, repaired)


class RetrievalService:
    """Cache in front of the micro-batcher; formats hits as Search-R1 documents."""

    def __init__(self, search: SearchFn, corpus, config: ServerConfig, info: dict[str, Any]):
        self.corpus = corpus
        self.config = config
        self.info = info
        self.cache = LRUCache(config.cache_size)
        self.batcher = MicroBatcher(search, config.max_batch_size, config.max_wait_ms / 1000.0)
        self.queries_truncated = 0
        self.queries_repaired = 0
        self.requests_refused = 0

    async def retrieve(self, queries: list[str], topk: int) -> list[Hits]:
        """Hits per query; a blank query has none (Search-R1 lets the trajectory go on with an empty observation)."""
        keys = [(normalize_query(q), topk) for q in queries]
        results: list[Hits | None] = [self.cache.get(k) if k[0] else [] for k in keys]
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            fresh = await self.batcher.submit([keys[i][0] for i in missing], topk)
            for i, hits in zip(missing, fresh, strict=True):
                results[i] = hits
                self.cache.put(keys[i], hits)
        return results  # type: ignore[return-value]

    def document(self, row: int) -> dict:
        return self.corpus[row]

    def format(self, hits_per_query: list[Hits], return_scores: bool) -> dict:
        if return_scores:
            result = [[{"document": self.document(r), "score": s} for r, s in hits] for hits in hits_per_query]
        else:
            result = [[self.document(r) for r, _ in hits] for hits in hits_per_query]
        return {"result": result}

    def health(self) -> dict:
        return {
            "status": "ok",
            "ready": True,
            "corpus_size": len(self.corpus),
            **self.info,
            "queue_depth": self.batcher.queue_depth,
            "batches": self.batcher.batches,
            "queries_searched": self.batcher.queries,
            "cache_size": len(self.cache),
            "cache_hit_rate": round(self.cache.hit_rate, 4),
            "queries_truncated": self.queries_truncated,
            "queries_repaired": self.queries_repaired,
            "requests_refused": self.requests_refused,
        }


def create_app(service: RetrievalService):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    @asynccontextmanager
    async def lifespan(app):
        service.batcher.start()
        yield
        await service.batcher.stop()

    app = FastAPI(title="slime-search retriever", lifespan=lifespan)

    @app.post("/retrieve")
    async def retrieve(request: Request):
        try:
            parsed = validate_request(parse_body(await request.body()), service.config)
        except RequestError as err:
            service.requests_refused += 1
            return JSONResponse({"detail": str(err)}, status_code=400)
        service.queries_truncated += parsed.truncated
        service.queries_repaired += parsed.repaired
        try:
            hits = await service.retrieve(parsed.queries, parsed.topk)
        except Exception as err:  # noqa: BLE001 - this request's search failed; the server carries on
            logger.exception("retrieval failed")
            return JSONResponse({"detail": f"retrieval failed: {type(err).__name__}: {err}"}, status_code=500)
        return JSONResponse(service.format(hits, parsed.return_scores))

    @app.get("/health")
    async def health():
        return service.health()

    return app


def load_retriever(args: argparse.Namespace):
    """The search function and the facts /health reports, from the CLI flags."""
    from local_dense_retriever.index import BM25Retriever, DenseRetriever, encoder_config_from_meta, read_meta

    if args.retriever_name == "bm25":
        retriever = BM25Retriever(args.index_path)
        return retriever, {"index_type": "bm25", "encoder": None, "index_size": retriever.size}
    meta = read_meta(Path(args.index_path))
    if not args.retriever_model and not meta.get("encoder"):
        raise ValueError(f"no --retriever-model given and no encoder recorded beside {args.index_path}")
    config = encoder_config_from_meta(
        meta, model_path=args.retriever_model, fp16=args.fp16 or None, batch_size=args.encoder_batch_size
    )
    retriever = DenseRetriever(args.index_path, config, faiss_gpu=args.faiss_gpu)
    return retriever, {"index_type": retriever.index_type, "encoder": config.model_path, "index_size": retriever.size}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index-path", "--index_path", required=True, help="faiss index file, or BM25 folder")
    parser.add_argument("--corpus-path", "--corpus_path", required=True, help='{"id","contents"} jsonl')
    parser.add_argument("--retriever-name", "--retriever_name", default="e5", help="e5, bge, bm25, ...")
    parser.add_argument("--retriever-model", "--retriever_model", default=None, help="default: from the index meta")
    parser.add_argument("--topk", type=int, default=3, help="results per query when a request gives no topk")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    parser.add_argument("--faiss-gpu", "--faiss_gpu", action="store_true", help="shard the index over all GPUs")
    parser.add_argument("--fp16", action="store_true", help="fp16 encoder and GPU index")
    parser.add_argument("--max-batch-size", type=int, default=256, help="queries per encoder/index batch")
    parser.add_argument("--max-wait-ms", type=float, default=2.0, help="longest wait for a batch to fill")
    parser.add_argument("--encoder-batch-size", type=int, default=64, help="queries per encoder forward pass")
    parser.add_argument("--cache-size", type=int, default=100_000, help="LRU entries; 0 disables the cache")
    parser.add_argument("--max-queries", type=int, default=16_384, help="queries per request")
    parser.add_argument("--max-query-chars", type=int, default=4096, help="longer queries are cut to this length")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args(argv)
    import uvicorn

    from local_dense_retriever.corpus import Corpus

    try:
        corpus = Corpus(args.corpus_path)
        retriever, info = load_retriever(args)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if info["index_size"] != len(corpus):
        print(
            f"error: the index holds {info['index_size']} vectors but the corpus has {len(corpus)} passages",
            file=sys.stderr,
        )
        return 2
    config = ServerConfig(
        default_topk=args.topk,
        max_batch_size=args.max_batch_size,
        max_wait_ms=args.max_wait_ms,
        cache_size=args.cache_size,
        max_queries=args.max_queries,
        max_query_chars=args.max_query_chars,
    )
    service = RetrievalService(retriever.search, corpus, config, info)
    sock = listen_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    print(f"serving on http://{host}:{port}", flush=True)
    server = uvicorn.Server(
        uvicorn.Config(create_app(service), log_level="warning", backlog=4096, timeout_keep_alive=30)
    )
    asyncio.run(server.serve(sockets=[sock]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
