"""A local stand-in for Serper's search API and the web pages it links to, for the Serper client tests.

    python tests/search_r1/serper_standin.py --port 0 --api-key KEY

POST /search answers Serper-shaped JSON for known queries; the query "busy" gets a 429 with Retry-After on its
first call, "redirect" a 307 to /capture under another origin (localhost), "garbled" a 200 that is not JSON,
"nothing" no results, "down" a 500, "odd" results with missing and non-text fields; "wait S REST" answers as for REST
after S seconds (and every query comes --latency-ms late). GET /page/{name} serves HTML pages in various encodings;
/page/slow never answers in time. /capture records the headers it received (GET /captured lists them).

POST /retrieve is a retriever that misbehaves on cue, for the local search client: a request holding the query
"garbled" gets a 200 that is not JSON, "no-result" a JSON object without `result`, "null-result" `result: null`,
"refuse" a 400 for the whole request (an older server's answer to one bad query); the query "no-contents" gets
documents without `contents`. Every other query gets one document that names it.

POST /generate is an engine that fails on cue, for the engine client: input_ids [STATUS, N] get STATUS for the first
N calls, then a one-token answer (STATUS 0: never fails).
"""

import argparse
import asyncio
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CAFE = "Le café de Flore est un café parisien très célèbre, situé boulevard Saint-Germain depuis 1887 environ."
PAGES = {
    "latin1": (
        f"<html><head><title>Flore</title><style>p {{}}</style></head><body><p>{CAFE}</p><p>Other text here.</p></body></html>".encode(
            "latin-1"
        ),
        None,
    ),
    "utf8": (
        b"<html><body><script>var x=1;</script><div>Header</div><p>The Eiffel Tower was completed in 1889 for the World's Fair in Paris.</p></body></html>",
        "utf-8",
    ),
}


def build_app(api_key: str, latency_s: float = 0.0):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    app = FastAPI()
    calls: dict[str, int] = {}

    captured: list[dict] = []
    retrieve_requests: list[int] = []

    @app.get("/health")
    async def health():
        return {"ok": True, "calls": calls, "retrieve_requests": retrieve_requests}

    @app.api_route("/capture", methods=["GET", "POST"])
    async def capture(request: Request):
        captured.append(dict(request.headers))
        return {"organic": [{"title": "Captured", "snippet": "a redirect target answered"}]}

    @app.get("/captured")
    async def captured_headers():
        return captured

    @app.post("/retrieve")
    async def retrieve(request: Request):
        queries = (await request.json())["queries"]
        retrieve_requests.append(len(queries))
        if "garbled" in queries:
            return Response(content=b"<html>502 from a proxy</html>", media_type="text/html")
        if "no-result" in queries:
            return {"answer": []}
        if "null-result" in queries:
            return {"result": None}
        if "refuse" in queries:
            return JSONResponse({"detail": "queries[0] is empty"}, status_code=400)
        result = [
            [{"title": q}] if q == "no-contents" else [{"document": {"contents": f'"{q}"\nabout {q}'}, "score": 1.0}]
            for q in queries
        ]
        return {"result": result}

    generate_calls: dict[str, int] = {}

    @app.post("/generate")
    async def generate(request: Request):
        """An engine that fails on cue: input_ids [STATUS, N] answers STATUS to the first N calls, then a one-token
        generation (N = 0: always STATUS; STATUS 0: never)."""
        body = await request.json()
        ids = body["input_ids"]
        key = ",".join(map(str, ids))
        generate_calls[key] = generate_calls.get(key, 0) + 1
        status, times = ids[0], ids[1]
        if status and (times == 0 or generate_calls[key] <= times):
            return JSONResponse({"error": {"message": f"failing on cue ({status})"}}, status_code=status)
        meta = {"finish_reason": {"type": "length", "length": 1}, "output_token_logprobs": [[-0.5, 7, None]]}
        meta["lora_path"] = body.get("lora_path")  # the adapter the request named (SGLang's field), for the tests
        return {"text": "x", "output_ids": [7], "meta_info": meta}

    @app.get("/generate_calls")
    async def generate_call_counts():
        return generate_calls

    @app.post("/search")
    async def search(request: Request):
        if request.headers.get("X-API-KEY") != api_key:
            return JSONResponse({"message": "Unauthorized."}, status_code=403)
        body = await request.json()
        query = body["q"]
        calls[query] = calls.get(query, 0) + 1
        await asyncio.sleep(latency_s)
        if query.startswith("wait "):  # "wait S REST": answers as for REST, S seconds later
            _, seconds, query = query.split(" ", 2)
            await asyncio.sleep(float(seconds))
        if query == "busy" and calls[query] == 1:
            return JSONResponse({"message": "rate limited"}, status_code=429, headers={"Retry-After": "1"})
        if query == "redirect":
            target = str(request.base_url).replace("127.0.0.1", "localhost").rstrip("/") + "/capture"
            return Response(status_code=307, headers={"Location": target})
        if query == "garbled":
            return Response(content=b"<html>upstream error</html>", media_type="text/html")
        if query == "nothing":  # Serper's answer to a query it found nothing for
            return {"searchParameters": {"q": query}, "organic": []}
        if query == "down":
            return JSONResponse({"message": "upstream unavailable"}, status_code=500)
        if query == "odd":
            organic = ["not an object", {"title": None, "snippet": 5}, {"title": "Fine", "snippet": "kept as it is"}]
            return {"organic": organic}
        base = str(request.base_url).rstrip("/")
        organic = [
            {"title": "Café de Flore", "link": f"{base}/page/latin1", "snippet": f"{CAFE[:60]} ... {CAFE[60:]}"},
            {"title": "No link here", "snippet": "An item without a link must keep its own snippet text in place."},
            {
                "title": "Eiffel Tower",
                "link": f"{base}/page/utf8",
                "snippet": "The Eiffel Tower was completed in 1889 for the World's Fair in Paris.",
            },
            {
                "title": "Slow",
                "link": f"{base}/page/slow",
                "snippet": "A page that never loads in time for the client to read it.",
            },
        ]
        return {"searchParameters": {"q": query}, "organic": organic[: body.get("num", 10)]}

    @app.get("/page/{name}")
    async def page(name: str):
        if name == "slow":
            await asyncio.sleep(30)
        raw, charset = PAGES[name]
        media = "text/html" + (f"; charset={charset}" if charset else "")
        return Response(content=raw, media_type=None, headers={"Content-Type": media})

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--latency-ms", type=float, default=0.0, help="every /search answer this much later")
    args = parser.parse_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", args.port))
    print(f"serving on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    # a stop must not wait for the never-answering /page/slow request to finish
    config = uvicorn.Config(
        build_app(args.api_key, args.latency_ms / 1000), log_level="warning", timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    asyncio.run(server.serve(sockets=[sock]))


if __name__ == "__main__":
    main()
