"""A scripted, deliberately imperfect demonstrator of the synthetic task, served behind SGLang's /generate API.

It writes Search-R1 turns in the tag format, or with --tool-format qwen3 searches as Qwen3's tool calls and reads the
tool responses. On a question it searches with probability `search_prob`. Then it reads the answer (or the founder, for
a two-hop question) out of the retrieved passages and answers, or searches again. Otherwise it guesses an answer of the
right kind without searching. Its trajectories are collected through the ordinary generate loop and the real
retriever. Supervised fine-tuning on them teaches a policy the format and how to use search results, but not that
searching pays: that is left for reinforcement learning.

    python -m slime_search.miniature.demonstrator --tokenizer POLICY_DIR --search-prob 0.3 --port 0
"""

# no `from __future__ import annotations`: FastAPI must see the real `Request` class of the nested handler
import argparse
import asyncio
import hashlib
import json
import random
import re

from slime_search.miniature.task import CITIES

QUESTION = re.compile(r"Question: (.*?\?)\n")
PATTERNS = [  # question template -> (attribute kind, hops); the entity is the captured name
    (re.compile(r"Where was the founder of (.+) born\?"), "city", 2),
    (re.compile(r"Who founded (.+)\?"), "founder", 1),
    (re.compile(r"Where was (.+) born\?"), "city", 1),
]
FACT = {  # attribute kind -> the sentence of a passage that states it, for an entity
    "city": r"{} was born in (\w+)\.",
    "founder": r"{} was founded by (\w+ \w+)\.",
}


def parse_question(question: str) -> tuple[str, str, int]:
    """(entity, attribute kind, hops) of a question of the synthetic task."""
    for pattern, kind, hops in PATTERNS:
        match = pattern.fullmatch(question)
        if match:
            return match.group(1), kind, hops
    raise ValueError(f"not a question of the synthetic task: {question!r}")


def read_fact(observations: str, entity: str, kind: str) -> str | None:
    match = re.search(FACT[kind].format(re.escape(entity)), observations)
    return match.group(1) if match else None


def guess(kind: str, rng: random.Random) -> str:
    if kind == "founder":
        return f"{rng.choice(['Bal', 'Kor', 'Min'])}ex {rng.choice(['Tovar', 'Rell', 'Osk'])}"
    return rng.choice(CITIES)


def searches_this_time(question: str, visit: int, seed: int, search_prob: float) -> bool:
    """A coin flip that depends on (seed, question, how often the question was asked), not on request order."""
    digest = hashlib.sha256(f"{seed}|{question}|{visit}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < search_prob


def tag_search(query: str) -> str:
    return f"<search> {query} </search>"


def tool_call_search(query: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'search', 'arguments': {'query': query}})}\n</tool_call>"


SEARCH_CALLS = {"tags": tag_search, "qwen3": tool_call_search}


def next_turn(
    question: str, observations: list[str], decide_search: bool, rng: random.Random, search_call=tag_search
) -> str:
    """The demonstrator's next turn, given the observations so far in this trajectory.

    Turns are bare actions, with no <think> block. Every copy the policy must learn, from the question into the query or
    from a passage into the answer, then sits a short, fixed distance back. A policy trained from scratch on two CPU
    cores picks that up within minutes.
    """
    entity, kind, hops = parse_question(question)
    if not observations:
        if decide_search:  # the question itself is the query
            return search_call(question)
        return f"<answer> {guess(kind, rng)} </answer>"
    if hops == 2 and len(observations) == 1:
        founder = read_fact(observations[0], entity, "founder")
        if founder is not None:
            return search_call(f"Where was {founder} born?")
        return f"<answer> {guess(kind, rng)} </answer>"
    subject = entity if hops == 1 else read_fact(observations[0], entity, "founder") or entity
    value = read_fact(observations[-1], subject, kind)
    return f"<answer> {value if value is not None else guess(kind, rng)} </answer>"


def observations_in(prompt: str) -> list[str]:
    """The <information> blocks (or, in the tool-call format, <tool_response> blocks) the assistant has received so
    far: after the first assistant header (the instructions and the tools' declaration come before it)."""
    trajectory = prompt.partition("<|im_start|>assistant\n")[2]
    blocks = re.findall(
        r"<information>(.*?)</information>|<tool_response>\n(.*?)\n</tool_response>", trajectory, re.DOTALL
    )
    return [tagged or tool for tagged, tool in blocks]


def build_app(tokenizer, seed: int, search_prob: float, tool_format: str = "tags"):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    from slime_search.miniature.scripted_turn import turn_response

    app = FastAPI()
    visits: dict[str, int] = {}
    rng = random.Random(seed)

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        prompt = tokenizer.decode(body["input_ids"])
        match = QUESTION.search(prompt)
        if match is None:
            return JSONResponse({"error": "no 'Question: ...?' line in the prompt"}, status_code=400)
        question, observations = match.group(1), observations_in(prompt)
        if not observations:
            visits[question] = visits.get(question, 0) + 1
        decide = searches_this_time(question, visits.get(question, 1), seed, search_prob)
        text = next_turn(question, observations, decide, rng, SEARCH_CALLS[tool_format])
        return turn_response(tokenizer, text, body, weight_version="demonstrator", log_prob=lambda i: 0.0)

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="the policy's folder (its tokenizer encodes the turns)")
    parser.add_argument("--search-prob", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tool-format", choices=tuple(SEARCH_CALLS), default="tags", help="how it calls search")
    args = parser.parse_args(argv)
    app = build_app(AutoTokenizer.from_pretrained(args.tokenizer), args.seed, args.search_prob, args.tool_format)
    from slime_search.utils.net import listen_socket

    sock = listen_socket("127.0.0.1", args.port)
    print(f"serving on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    asyncio.run(uvicorn.Server(uvicorn.Config(app, log_level="warning")).serve(sockets=[sock]))


if __name__ == "__main__":
    main()
