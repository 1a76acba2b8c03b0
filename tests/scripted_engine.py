"""A stand-in for an SGLang engine whose "model" follows a script, for testing the multi-turn loop.

    python tests/scripted_engine.py --tokenizer DIR --script SCRIPT.json --port 0

SCRIPT.json maps a substring of the prompt (e.g. the question) to the texts of successive turns. The turn
number is the count of observations already in the assistant's part of the prompt. Output ids are the tokenizer's encoding of the
scripted text, cut to max_new_tokens; every request is recorded and served back by GET /requests.
"""

import argparse
import asyncio
import json
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OBSERVATION_MARKERS = ("</information>", "My previous action is invalid.")


def build_app(tokenizer, script: dict[str, list[str]]):
    from fastapi import FastAPI, Request

    app = FastAPI()
    requests: list[dict] = []

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.get("/requests")
    async def recorded():
        return requests

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        requests.append(body)
        prompt = tokenizer.decode(body["input_ids"])
        turns = next(texts for key, texts in script.items() if key in prompt)
        trajectory = prompt.rpartition("<|im_start|>assistant\n")[2]  # the instructions mention </information> too
        turn = sum(trajectory.count(marker) for marker in OBSERVATION_MARKERS)
        text = turns[min(turn, len(turns) - 1)]
        ids = tokenizer.encode(text, add_special_tokens=False)
        params = body.get("sampling_params", {})
        limit = params.get("max_new_tokens", len(ids))
        finish = {"type": "stop", "matched": next((s for s in params.get("stop", []) if text.endswith(s)), None)}
        if ids and ids[-1] in (151643, 151645):
            finish = {"type": "stop", "matched": ids[-1]}
        if len(ids) > limit:
            ids, finish = ids[:limit], {"type": "length", "length": limit}
        return {
            "text": tokenizer.decode(ids),
            "output_ids": ids,
            "meta_info": {
                "finish_reason": finish,
                "output_token_logprobs": [[-0.01 * (i + 1), t, None] for i, t in enumerate(ids)],
                "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(ids),
                "weight_version": "7",
            },
        }

    return app


def main() -> None:
    import uvicorn
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--script", required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    app = build_app(AutoTokenizer.from_pretrained(args.tokenizer), json.loads(Path(args.script).read_text()))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", args.port))
    print(f"serving on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    asyncio.run(uvicorn.Server(uvicorn.Config(app, log_level="warning")).serve(sockets=[sock]))


if __name__ == "__main__":
    main()
