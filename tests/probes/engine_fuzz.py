"""Fuzz the CPU engine server: random JSON, random bytes and random pickles to every POST endpoint, answers counted.

    python -m tests.probes.engine_fuzz --model-path CKPT [--requests 1000] [--seed 0]

It starts the server on the checkpoint (or takes `--url` of a running one serving it), sends `--requests` bodies to
each endpoint, prints per endpoint how many got 2xx, 4xx, 5xx or no answer, then checks the engine still serves:
/health answers, its weights are restored from the checkpoint (the fuzz releases and resumes memory, as any client
may) and a greedy /generate gives the same tokens as before the fuzz. Exit status 1 if any 5xx, lost connection or
failed check.
"""

from __future__ import annotations

import argparse
import base64
import json
import pickle
import random
import string
import sys
from collections import Counter
from typing import Any

# Fields each endpoint reads; the fuzz puts random values under these names as often as under random ones.
ENDPOINT_FIELDS = {
    "/generate": ("input_ids", "text", "sampling_params", "return_logprob", "rid", "stream"),
    "/abort_request": ("rid", "abort_all"),
    "/pause_generation": ("mode",),
    "/continue_generation": ("torch_empty_cache",),
    "/flush_cache": (),
    "/begin_weight_update": (),
    "/end_weight_update": (),
    "/update_weights_from_tensor": ("serialized_named_tensors", "load_format", "weight_version"),
    "/init_weights_update_group": (
        "master_address", "master_port", "rank_offset", "world_size", "group_name", "backend",
    ),
    "/update_weights_from_distributed": ("names", "dtypes", "shapes", "group_name", "weight_version"),
    "/destroy_weights_update_group": ("group_name",),
    "/update_weights_from_disk": ("model_path", "weight_version"),
    "/release_memory_occupation": ("tags",),
    "/resume_memory_occupation": ("tags",),
}  # fmt: skip
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids", "no_stop_trim",
    "skip_special_tokens", "ignore_eos",
)  # fmt: skip
# Bodies Python's JSON parser refuses or turns into non-finite numbers.
HOSTILE_BODIES = (
    b"[" * 100_000,
    b'{"a": ' * 50_000,
    b"9" * 5_000,
    b'{"sampling_params": {"temperature": NaN}, "input_ids": [1]}',
    b'{"sampling_params": {"temperature": Infinity}, "input_ids": [1]}',
    b'{"sampling_params": {"top_p": 1e999}, "input_ids": [1]}',
    b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 1e3}}',
    b'{"text": "\\ud800"}',
    b"\xff\xfe\x00",
    b"",
    b"null",
)


def random_string(rng: random.Random) -> str:
    alphabet = string.printable + '\u00e9\u4e2d\U0001f600<>/\\"'
    return "".join(rng.choice(alphabet) for _ in range(rng.choice((0, 1, 5, 40))))


def random_scalar(rng: random.Random) -> Any:
    kind = rng.randrange(9)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.randint(-3, 10)
    if kind == 3:
        return rng.randint(-(10**30), 10**30)
    if kind == 4:
        return int("9" * rng.randint(20, 400))
    if kind == 5:
        return rng.choice((0.0, -1.5, 0.5, 1e-300, 1e300, 2.0))
    if kind == 6:
        return rng.randint(151_000, 160_000)  # around a real vocabulary's end
    return random_string(rng)


def random_value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth >= 3 or roll < 0.6:
        return random_scalar(rng)
    if roll < 0.8:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {random_string(rng): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


class Call:
    """Pickles as the call fn(*args)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def rebuilder_call(rng: random.Random) -> Call:
    """One of torch's tensor and storage rebuilders, which the engine's payload allowlist admits, with random
    arguments (a malformed handle)."""
    from torch.multiprocessing import reductions

    names = sorted(n for n in dir(reductions) if n.startswith("rebuild_") and "cuda" not in n)
    args = [random_scalar(rng) for _ in range(rng.randint(0, 7))]
    return Call(getattr(reductions, rng.choice(names)), *args)


def random_pickle(rng: random.Random) -> bytes:
    """A pickle of random data, of a rebuilder fed random arguments, or of a tensor (plain pickle, or shared-memory
    handles with a made-up name)."""
    import torch

    roll = rng.random()
    if roll < 0.3:
        return pickle.dumps(random_value(rng), protocol=rng.choice((2, 4, 5)))
    if roll < 0.45:
        return pickle.dumps([(random_string(rng), rebuilder_call(rng))])
    if roll < 0.6:
        return pickle.dumps([("model.embed_tokens.weight", torch.zeros(rng.randint(0, 4)))])
    from slime_search.engines.weight_wire import serialize_named_tensors

    name = rng.choice(("model.embed_tokens.weight", "lm_head.weight", random_string(rng)))
    tensor = torch.zeros([rng.randint(0, 3) for _ in range(rng.randint(0, 3))])
    return base64.b64decode(serialize_named_tensors([(name, tensor)]))


def field_value(rng: random.Random, field: str) -> Any:
    if field == "sampling_params" and rng.random() < 0.7:
        fields = rng.sample(SAMPLING_FIELDS, rng.randint(1, 4))
        return {name: random_value(rng) for name in fields}
    if field == "serialized_named_tensors" and rng.random() < 0.7:
        return [base64.b64encode(random_pickle(rng)).decode()]
    if field == "input_ids" and rng.random() < 0.5:
        return [random_scalar(rng) for _ in range(rng.randrange(4))]
    return random_value(rng)


def joins_a_group(body: dict) -> bool:
    """Whether a /init_weights_update_group body is well formed: the engine would then wait, by design, for the
    rendezvous at that address (up to its timeout), which a fuzz cannot serve."""
    from slime_search.engines.validation import BadRequest, weight_group_join

    try:
        weight_group_join(body, "fuzz")
    except BadRequest:
        return False
    return True


def random_body(rng: random.Random, endpoint: str) -> bytes:
    """One fuzz body for `endpoint`: an object of its own fields, any JSON value, bytes, a pickle, or hostile JSON."""
    roll = rng.random()
    if roll < 0.45:
        fields = ENDPOINT_FIELDS[endpoint] or ("x",)
        chosen = rng.sample(fields, rng.randint(1, len(fields)))
        body = {name: field_value(rng, name) for name in chosen}
        if endpoint == "/init_weights_update_group" and joins_a_group(body):
            body.pop("master_address")
        return json.dumps(body).encode()
    if roll < 0.65:
        return json.dumps(random_value(rng)).encode()
    if roll < 0.8:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    if roll < 0.9:
        return random_pickle(rng)
    return rng.choice(HOSTILE_BODIES)


def outcome(status: int | None) -> str:
    if status is None:
        return "no answer"
    return f"{status // 100}xx"


UPDATES = ("/update_weights_from_tensor", "/update_weights_from_distributed", "/update_weights_from_disk")


def version_set_by(endpoint: str, body: bytes, status: int) -> str | None:
    """The weight version a successful update carried (the engine serves it from then on), if any."""
    if endpoint not in UPDATES or status >= 300:
        return None
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    version = payload.get("weight_version") if isinstance(payload, dict) else None
    return version if isinstance(version, str) else None


def fuzz(
    url: str, requests: int, seed: int, timeout_s: float = 60.0, versions_set: list[str] | None = None
) -> dict[str, Counter]:
    """`requests` random bodies to each endpoint, in an order that keeps the engine able to serve the next
    (memory is released and resumed last); the tensor endpoint is fuzzed inside a weight-update session, so its
    payloads reach the decoder. Returns per endpoint the count of each outcome; `versions_set` receives the weight
    version of every update that succeeded with one, in order."""
    import httpx

    rng = random.Random(seed)
    counts: dict[str, Counter] = {}
    with httpx.Client(base_url=url, timeout=timeout_s) as client:
        for endpoint in ENDPOINT_FIELDS:
            if endpoint == "/update_weights_from_tensor":
                client.post("/begin_weight_update", json={})
            tally = counts.setdefault(endpoint, Counter())
            for _ in range(requests):
                body = random_body(rng, endpoint)
                try:
                    response = client.post(endpoint, content=body, headers={"content-type": "application/json"})
                    tally[outcome(response.status_code)] += 1
                    version = version_set_by(endpoint, body, response.status_code)
                    if version is not None and versions_set is not None:
                        versions_set.append(version)
                except httpx.HTTPError:
                    tally[outcome(None)] += 1
            if endpoint == "/update_weights_from_tensor":
                client.post("/end_weight_update", json={})
            if endpoint == "/pause_generation":  # a pause the fuzz made must not hold the next endpoints' requests
                client.post("/continue_generation", json={})
    return counts


def greedy_tokens(url: str) -> list[int]:
    import httpx

    body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
    response = httpx.post(f"{url}/generate", json=body, timeout=60)
    response.raise_for_status()
    return response.json()["output_ids"]


def restore(url: str, model_path: str) -> None:
    """Give the engine its memory and the checkpoint's weights back (the fuzz may have released or resumed them)."""
    import httpx

    httpx.post(f"{url}/end_weight_update", json={}, timeout=60)  # 400 when none is open: fine
    httpx.post(f"{url}/continue_generation", json={}, timeout=60).raise_for_status()
    httpx.post(f"{url}/resume_memory_occupation", json={}, timeout=60).raise_for_status()
    answer = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": model_path}, timeout=120).json()
    if not answer.get("success"):
        raise RuntimeError(f"could not restore the weights from {model_path}: {answer}")


def table(counts: dict[str, Counter]) -> str:
    columns = ("2xx", "4xx", "5xx", "no answer")
    lines = ["| endpoint | requests | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]
    for endpoint, tally in counts.items():
        cells = " | ".join(str(tally.get(c, 0)) for c in columns)
        lines.append(f"| {endpoint} | {sum(tally.values())} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import httpx

    from slime_search.utils.server_process import ServerProcess

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True, help="the checkpoint the engine serves (to restore it)")
    parser.add_argument("--url", default=None, help="a running CPU engine serving --model-path")
    parser.add_argument("--requests", type=int, default=1000, help="bodies per endpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a request may take before it counts lost")
    args = parser.parse_args(argv)
    server = None
    if args.url is None:
        argv = ["-m", "slime_search.engines.cpu_engine_server", "--model-path", args.model_path, "--port", "0"]
        server = ServerProcess(argv)
    url = args.url or server.url
    try:
        version = httpx.get(f"{url}/model_info", timeout=30).json()["weight_version"]
        before = greedy_tokens(url)
        versions_set: list[str] = []
        counts = fuzz(url, args.requests, args.seed, args.timeout, versions_set)
        print(table(counts))
        alive = httpx.get(f"{url}/health", timeout=30).status_code == 200
        restore(url, args.model_path)
        same = greedy_tokens(url) == before
        expected = versions_set[-1] if versions_set else version  # a successful update with a version changes it
        kept_version = httpx.get(f"{url}/model_info", timeout=30).json()["weight_version"] == expected
        print(f"after the fuzz: /health {'200' if alive else 'failed'}; greedy tokens unchanged: {same}; "
              f"weight version as the successful updates left it ({len(versions_set)} set one): {kept_version}")  # fmt: skip
    finally:
        if server is not None:
            server.stop()
    failures = sum(t.get("5xx", 0) + t.get("no answer", 0) for t in counts.values())
    return 0 if failures == 0 and alive and same and kept_version else 1


if __name__ == "__main__":
    sys.exit(main())
