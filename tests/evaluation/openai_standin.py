"""A local stand-in for an OpenAI-compatible chat endpoint, for the LLM judge's tests.

    python tests/evaluation/openai_standin.py --port 0 --api-key KEY

POST /v1/chat/completions grades as a lenient judge would: "yes" when a reference answer's words all appear in the
candidate answer (so "the 44th president Barack Obama" passes for "Barack Obama"), else "no"; usage counts words.
A candidate answer "flaky" gets a 503 on its first call, "broken" a 500 always, "chatty" a reply that is not yes or
no. A wrong key gets a 401. GET /calls says how many completions were asked for.
"""

import argparse
import asyncio
import re
import socket


def build_app(api_key: str):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI()
    state = {"calls": 0, "flaky": 0}

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.get("/calls")
    async def calls():
        return {"calls": state["calls"]}

    @app.post("/v1/chat/completions")
    async def complete(request: Request):
        if request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse({"error": {"message": "invalid api key"}}, status_code=401)
        body = await request.json()
        state["calls"] += 1
        prompt = body["messages"][-1]["content"]
        references = re.search(r"Reference answers: (.*)\n", prompt).group(1).split("; ")
        candidate = re.search(r"Candidate answer: (.*)\n", prompt).group(1)
        if candidate == "flaky" and state["flaky"] == 0:
            state["flaky"] += 1
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        if candidate == "broken":
            return JSONResponse({"error": {"message": "internal"}}, status_code=500)
        words = set(candidate.lower().split())
        accepted = any(set(ref.lower().split()) <= words for ref in references) or candidate == "flaky"
        reply = "I think so, probably" if candidate == "chatty" else ("Yes" if accepted else "No.")
        usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": 1}
        return {"choices": [{"message": {"role": "assistant", "content": reply}}], "usage": usage}

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--api-key", required=True)
    args = parser.parse_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", args.port))
    print(f"serving on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    server = uvicorn.Server(uvicorn.Config(build_app(args.api_key), log_level="warning"))
    asyncio.run(server.serve(sockets=[sock]))


if __name__ == "__main__":
    main()
