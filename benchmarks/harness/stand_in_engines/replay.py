"""An engine behind SGLang's /generate API whose "model" replays scripted or recorded turns.

    python -m benchmarks.harness.stand_in_engines.replay --tokenizer DIR --script SCRIPT.json --port 0
    python -m benchmarks.harness.stand_in_engines.replay --tokenizer DIR --trajectories ../shared/data/trajectories/X.jsonl

It drives the multi-turn loop with a known policy. In tests it follows a script: a substring of the prompt, e.g.
the question, mapped to the texts of successive turns. In the rollout benchmark it replays real Search-R1
trajectories, split into turns at their <information> blocks. There searches follow the real model's pattern while
the retriever and the search client do real work. The turn number is the count of observations already in the
assistant's part of the prompt (in a chat template's own tool format, the assistant headers after the first).
Output ids are the tokenizer's encoding of the turn text, cut to
max_new_tokens; every request is recorded and served back by GET /requests.
"""

import argparse
import asyncio
import json
import re
from pathlib import Path

from slime_search.miniature.scripted_turn import turn_response

OBSERVATION_MARKERS = ("</information>", "My previous action is invalid.")


def turn_number(prompt: str) -> int:
    """How many turns the trajectory in `prompt` already has: observations after the first assistant header (the
    instructions mention </information> too); in the chat template's own tool format, every turn after the first
    opens a new assistant header."""
    _, header, trajectory = prompt.partition("<|im_start|>assistant\n")
    if not header:  # no chat template: the whole prompt
        trajectory = prompt
    elif "<|im_start|>assistant\n" in trajectory:
        return trajectory.count("<|im_start|>assistant\n")
    return sum(trajectory.count(marker) for marker in OBSERVATION_MARKERS)


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
        prompt = body["text"] if "text" in body else tokenizer.decode(body["input_ids"])  # SGLang takes either
        turns = next(texts for key, texts in script.items() if key in prompt)
        turn = turn_number(prompt)
        text = turns[min(turn, len(turns) - 1)]
        return turn_response(tokenizer, text, body, weight_version="7", log_prob=lambda i: -0.01 * (i + 1))

    return app


_OBSERVATION = re.compile(r"\s*<information>.*?</information>\s*", re.DOTALL)


def turns_from_trajectory(response: str) -> list[str]:
    """A recorded response split into the model's turns (the text between observations)."""
    turns = [t for t in _OBSERVATION.split(response)]
    return [t for t in turns if t.strip()] or [response]


def script_from_trajectories(path: str) -> dict[str, list[str]]:
    script = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        script[row["question"]] = turns_from_trajectory(row["response"])
    return script


def main() -> None:
    import uvicorn
    from transformers import AutoTokenizer

    from slime_search.utils.net import listen_socket

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--script", help="JSON: prompt substring -> list of turn texts")
    source.add_argument("--trajectories", help="Search-R1 trajectories jsonl (question, response)")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    script = json.loads(Path(args.script).read_text()) if args.script else script_from_trajectories(args.trajectories)
    app = build_app(AutoTokenizer.from_pretrained(args.tokenizer), script)
    sock = listen_socket("127.0.0.1", args.port)
    print(f"serving on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    asyncio.run(uvicorn.Server(uvicorn.Config(app, log_level="warning")).serve(sockets=[sock]))


if __name__ == "__main__":
    main()
