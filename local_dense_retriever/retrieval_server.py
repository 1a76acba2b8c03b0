"""Search-R1's `/retrieve` API over a local corpus, with micro-batching, a query cache and request validation.

    python local_dense_retriever/retrieval_server.py --index-path indexes/e5_Flat.index \
        --corpus-path wiki-18.jsonl --retriever-model intfloat/e5-base-v2 --topk 3 [--port 8000] [--faiss-gpu]
    python local_dense_retriever/retrieval_server.py --retriever-name bm25 --index-path indexes/bm25 \
        --corpus-path wiki-18.jsonl

POST /retrieve {"queries": [...], "topk": 3, "return_scores": false}   (or {"query": "..."}, SkyRL's form)
  -> {"result": [[{"id", "contents"}, ...] per query]}, or [{"document": {...}, "score": s}, ...] with scores.
     (Each document is the corpus row as it is: ASearcher's wiki_corpus.jsonl rows carry their "url" too.)
POST /access {"urls": [...]} -> {"result": [page row or null per url]}   (ASearcher's and RLinf's page access;
  needs --pages-path)
GET /health -> readiness, corpus size, index type, encoder, queue depth, cache hit rate, repaired queries.

Bounded under mixed load: a request of many queries is searched in slices that share each batch equally with the
small requests beside it; more than --max-pending-queries waiting gets 503 with Retry-After; a body over
--max-body-bytes gets 413; a connection slower than --header-timeout / --body-timeout to send its request is closed.

Every well-formed request is answered per query. An empty or blank query gets an empty list. An over-long one is cut to
--max-query-chars, and one with unpaired surrogates has them replaced (both counted in /health). So one odd query never
fails its neighbours. A malformed request gets a 400 with a message, never a 5xx. Binds 127.0.0.1 unless --host says
otherwise.
"""

import argparse
import asyncio
import json
import logging
import os
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from local_dense_retriever.batching import (  # noqa: E402
    Hits,
    LRUCache,
    MicroBatcher,
    Overloaded,
    SearchFn,
    normalize_query,
)
from local_dense_retriever.onnx_forward import RUNTIMES  # noqa: E402
from slime_search.utils.http_limits import BodyTooLarge, bounded_h11_protocol, read_body  # noqa: E402
from slime_search.utils.net import listen_socket  # noqa: E402

logger = logging.getLogger(__name__)
INLINE_RENDER_DOCS = 64  # answers of at most this many documents are serialised on the event loop


@dataclass(frozen=True)
class ServerConfig:
    default_topk: int = 3
    max_topk: int = 100
    max_queries: int = 16_384  # Search-R1 sends a whole GRPO batch in one request (512 x 5 = 2,560 queries)
    max_query_chars: int = 4096
    max_batch_size: int = 256
    max_wait_ms: float = 2.0
    cache_size: int = 100_000
    max_pending_queries: int = 131_072  # waiting at once; beyond it 503 + Retry-After
    max_body_bytes: int = 16 << 20  # a whole GRPO batch of 2,560 queries is ~0.3 MB
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0


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


def validate_access(body: Any, config: ServerConfig) -> list[str]:
    """The URLs of an /access request: {"urls": ["...", ...]} (ASearcher's and RLinf's form)."""
    urls = body.get("urls") if isinstance(body, dict) else None
    if not isinstance(urls, list) or not urls:
        raise RequestError('body must be a JSON object like {"urls": ["https://..."]}')
    if len(urls) > config.max_queries:
        raise RequestError(f"too many urls: {len(urls)} > {config.max_queries}; split the request")
    for i, url in enumerate(urls):
        if not isinstance(url, str):
            raise RequestError(f"urls[{i}] is a {type(url).__name__}, not a string")
    return [_valid_text(url) for url in urls]


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

    def __init__(self, search: SearchFn, corpus, config: ServerConfig, info: dict[str, Any], pages=None):
        self.corpus = corpus
        self.pages = pages  # a pages.PageStore for /access, or None
        self.config = config
        self.info = info
        self.cache = LRUCache(config.cache_size)
        self.batcher = MicroBatcher(
            search, config.max_batch_size, config.max_wait_ms / 1000.0, config.max_pending_queries
        )
        self.queries_truncated = 0
        self.queries_repaired = 0
        self.requests_refused = 0
        self.requests_too_large = 0
        self.pages_served = 0
        self.pages_missing = 0

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

    def access(self, urls: list[str]) -> list[dict | None]:
        """The page of each URL, or None for one the pages file does not hold (ASearcher answers null too)."""
        pages = [self.pages.get(url) for url in urls]
        self.pages_served += sum(p is not None for p in pages)
        self.pages_missing += sum(p is None for p in pages)
        return pages

    def document(self, row: int) -> dict:
        return self.corpus[row]

    def format(self, hits_per_query: list[Hits], return_scores: bool) -> dict:
        if return_scores:
            result = [[{"document": self.document(r), "score": s} for r, s in hits] for hits in hits_per_query]
        else:
            result = [[self.document(r) for r, _ in hits] for hits in hits_per_query]
        return {"result": result}

    def render(self, hits_per_query: list[Hits], return_scores: bool) -> bytes:
        """The answer's JSON body, as JSONResponse would write it."""
        return json.dumps(
            self.format(hits_per_query, return_scores), ensure_ascii=False, separators=(",", ":")
        ).encode()

    def health(self) -> dict:
        return {
            "status": "ok",
            "ready": True,
            "corpus_size": len(self.corpus),
            **self.info,
            "queue_depth": self.batcher.queue_depth,
            "pending_queries": self.batcher.pending_queries,
            "batches": self.batcher.batches,
            "queries_searched": self.batcher.queries,
            "cache_size": len(self.cache),
            "cache_hit_rate": round(self.cache.hit_rate, 4),
            "queries_truncated": self.queries_truncated,
            "queries_repaired": self.queries_repaired,
            "requests_refused": self.requests_refused,
            "requests_too_large": self.requests_too_large,
            "requests_overloaded": self.batcher.requests_overloaded,
            "pages": len(self.pages) if self.pages is not None else 0,
            "pages_served": self.pages_served,
            "pages_missing": self.pages_missing,
        }


def create_app(service: RetrievalService):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    @asynccontextmanager
    async def lifespan(app):
        service.batcher.start()
        yield
        await service.batcher.stop()

    app = FastAPI(title="slime-search retriever", lifespan=lifespan)

    @app.post("/retrieve")
    async def retrieve(request: Request):
        try:
            raw = await read_body(request, service.config.max_body_bytes)
        except BodyTooLarge as err:  # refused before it is read: close, not to read the rest of it
            service.requests_too_large += 1
            return JSONResponse({"detail": str(err)}, status_code=413, headers={"Connection": "close"})
        try:
            parsed = validate_request(parse_body(raw), service.config)
        except RequestError as err:
            service.requests_refused += 1
            return JSONResponse({"detail": str(err)}, status_code=400)
        service.queries_truncated += parsed.truncated
        service.queries_repaired += parsed.repaired
        try:
            hits = await service.retrieve(parsed.queries, parsed.topk)
        except Overloaded as err:
            return JSONResponse({"detail": str(err)}, status_code=503, headers={"Retry-After": str(err.retry_after_s)})
        except Exception as err:  # noqa: BLE001 - this request's search failed; the server carries on
            logger.exception("retrieval failed")
            return JSONResponse({"detail": f"retrieval failed: {type(err).__name__}: {err}"}, status_code=500)
        # A large answer is read from the corpus and serialised off the event loop: a 5,000-query answer takes a
        # while, and the small requests beside it must not wait for it. A small one takes microseconds, less than
        # the hand-over to a thread and back.
        if sum(map(len, hits)) <= INLINE_RENDER_DOCS:
            body = service.render(hits, parsed.return_scores)
        else:
            body = await asyncio.to_thread(service.render, hits, parsed.return_scores)
        return Response(content=body, media_type="application/json")

    @app.post("/access")
    async def access(request: Request):
        if service.pages is None:
            detail = "this server holds no pages: start it with --pages-path wiki_webpages.jsonl"
            return JSONResponse({"detail": detail}, status_code=404)
        try:
            raw = await read_body(request, service.config.max_body_bytes)
        except BodyTooLarge as err:
            service.requests_too_large += 1
            return JSONResponse({"detail": str(err)}, status_code=413, headers={"Connection": "close"})
        try:
            urls = validate_access(parse_body(raw), service.config)
        except RequestError as err:
            service.requests_refused += 1
            return JSONResponse({"detail": str(err)}, status_code=400)
        return JSONResponse({"result": await asyncio.to_thread(service.access, urls)})

    @app.get("/health")
    async def health():
        return service.health()

    return app


def encoder_threads(requested: int | None, asked: str, runtime: str, cores: int) -> tuple[int, int]:
    """(torch's threads, ONNX Runtime's) for the query encoder: `requested` (--encoder-threads) for both when given;
    else ONNX Runtime gets one per core this process may use, its idle threads told not to spin. With two it served
    1.2-1.5x the queries of one beside 256 clients on two cores (docs/benchmarks/retrieval.md). Torch gets one thread
    when asked for by name (`asked`, --encoder-runtime torch). A team of torch threads meets at a barrier after every
    operation. On cores that other processes share, one preempted member stalls the rest: one thread held up where two
    collapsed. Where "auto" falls back to torch (ONNX Runtime not installed) torch takes the cores: one thread would
    serve a GPU node's many cores at a fraction of their speed."""
    if requested is not None:
        return requested, requested
    if runtime == "torch" and asked == "auto":
        return cores, cores
    return 1, cores


def load_retriever(args: argparse.Namespace):
    """The search function and the facts /health reports, from the CLI flags."""
    from local_dense_retriever.index import BM25Retriever, DenseRetriever, encoder_config_from_meta, read_meta

    if args.retriever_name == "bm25":
        retriever = BM25Retriever(args.index_path)
        return retriever, {
            "index_type": "bm25",
            "encoder": None,
            "index_size": retriever.size,
            "encoder_runtime": None,
            "encoder_threads": None,
        }
    meta = read_meta(Path(args.index_path))
    if not args.retriever_model and not meta.get("encoder"):
        raise ValueError(f"no --retriever-model given and no encoder recorded beside {args.index_path}")
    config = encoder_config_from_meta(
        meta, model_path=args.retriever_model, fp16=args.fp16 or None, batch_size=args.encoder_batch_size
    )
    import torch

    from local_dense_retriever.onnx_forward import resolve_runtime

    runtime = resolve_runtime(args.encoder_runtime, "cuda" if torch.cuda.is_available() else "cpu")
    torch_threads, onnx_threads = encoder_threads(
        args.encoder_threads, args.encoder_runtime, runtime, len(os.sched_getaffinity(0))
    )
    if torch_threads:
        torch.set_num_threads(torch_threads)
    retriever = DenseRetriever(
        args.index_path,
        config,
        faiss_gpu=args.faiss_gpu,
        runtime=args.encoder_runtime,
        threads=onnx_threads,
        search_params=args.faiss_search_params,
    )
    if retriever.search_params:
        logger.info("faiss searches %s with %s", args.index_path, retriever.search_params)
    facts = {"index_type": retriever.index_type, "encoder": config.model_path, "index_size": retriever.size}
    return retriever, {
        **facts,
        "encoder_runtime": retriever.encoder.runtime,
        "encoder_threads": retriever.encoder.threads,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index-path", "--index_path", required=True, help="faiss index file, or BM25 folder")
    parser.add_argument("--corpus-path", "--corpus_path", required=True, help='{"id","contents"} jsonl')
    parser.add_argument(
        "--pages-path",
        "--pages_path",
        default=None,
        help='whole pages for POST /access: a jsonl of {"url","contents"} (ASearcher\'s wiki_webpages.jsonl)',
    )
    parser.add_argument(
        "--save-address-to",
        "--save_address_to",
        default=None,
        help="a folder to write Host{ip}_IP{port}.txt holding ip:port into, once serving (ASearcher's address file)",
    )
    parser.add_argument("--retriever-name", "--retriever_name", default="e5", help="e5, bge, bm25, ...")
    parser.add_argument("--retriever-model", "--retriever_model", default=None, help="default: from the index meta")
    parser.add_argument("--topk", type=int, default=3, help="results per query when a request gives no topk")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    parser.add_argument("--faiss-gpu", "--faiss_gpu", action="store_true", help="shard the index over all GPUs")
    parser.add_argument("--fp16", action="store_true", help="fp16 encoder and GPU index")
    parser.add_argument(
        "--faiss-search-params",
        default="auto",
        help="faiss search parameters of an approximate index, as faiss's ParameterSpace takes them (e.g. "
        "'nprobe=128' for IVF, 'efSearch=256' for HNSW); auto: nprobe 64 and efSearch 128 unless the index file set "
        "wider; '' keeps the file's own",
    )
    parser.add_argument("--max-batch-size", type=int, default=256, help="queries per encoder/index batch")
    parser.add_argument("--max-wait-ms", type=float, default=2.0, help="longest wait for a batch to fill")
    parser.add_argument("--encoder-batch-size", type=int, default=64, help="queries per encoder forward pass")
    parser.add_argument(
        "--encoder-threads",
        type=int,
        default=None,
        help="CPU threads of one encoder forward pass (intra-op); default: one per core for ONNX Runtime, and for "
        "torch when it serves because ONNX Runtime is not installed; 1 for --encoder-runtime torch; 0: the runtime's "
        "own default",
    )
    parser.add_argument(
        "--encoder-runtime",
        choices=RUNTIMES,
        default="auto",
        help="the query encoder's forward pass: ONNX Runtime (CPU; exported at start and checked against torch) or "
        "torch; auto: ONNX Runtime on CPU when installed, else torch",
    )
    parser.add_argument("--cache-size", type=int, default=100_000, help="LRU entries; 0 disables the cache")
    parser.add_argument("--max-queries", type=int, default=16_384, help="queries per request")
    parser.add_argument("--max-query-chars", type=int, default=4096, help="longer queries are cut to this length")
    parser.add_argument(
        "--max-pending-queries",
        type=int,
        default=131_072,
        help="queries waiting at once; a request beyond it gets 503 with Retry-After",
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=16 << 20, help="larger request bodies get 413 (default 16 MiB)"
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection may take to send a request's headers before it is closed",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=60.0,
        help="seconds a request may take to send its body after its headers before the connection is closed",
    )
    return parser.parse_args(argv)


def load_pages(path: str | None):
    """The pages for /access, or None without --pages-path. FileNotFoundError for a path that is not a file (ASearcher
    starts without its pages then, and every /access fails)."""
    if path is None:
        return None
    from local_dense_retriever.pages import PageStore

    return PageStore(path)


def write_address_file(folder: Path, host: str, port: int) -> Path:
    """ASearcher's address file, which its training clients pick a server from: FOLDER/Host{ip}_IP{port}.txt."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"Host{host}_IP{port}.txt"
    path.write_text(f"{host}:{port}")
    return path


def serving_config(app, config: ServerConfig):
    """uvicorn settings: a deep backlog for bursts of rollout clients, and connections too slow to send a request
    closed (bounded_h11_protocol)."""
    import uvicorn

    protocol = bounded_h11_protocol(config.header_timeout_s, config.body_timeout_s)
    return uvicorn.Config(app, log_level="warning", backlog=4096, timeout_keep_alive=30, http=protocol)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args(argv)
    import uvicorn

    from local_dense_retriever.corpus import Corpus

    try:
        corpus = Corpus(args.corpus_path)
        pages = load_pages(args.pages_path)
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
        max_pending_queries=args.max_pending_queries,
        max_body_bytes=args.max_body_bytes,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
    )
    service = RetrievalService(retriever.search, corpus, config, info, pages)
    sock = listen_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    if args.save_address_to:
        write_address_file(Path(args.save_address_to), host, port)
    print(f"serving on http://{host}:{port}", flush=True)
    server = uvicorn.Server(serving_config(create_app(service), config))
    asyncio.run(server.serve(sockets=[sock]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
