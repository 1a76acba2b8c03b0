"""Every malformed body or parameter the CPU engine server gets is a 400 with a message, never a 500, and the engine
keeps serving: the cases a reliability review found answered 500, then a seeded fuzz of every POST endpoint."""

import argparse
import base64
import os
import pickle
import shutil

import httpx
import pytest
import torch
from torch.multiprocessing import reductions

from slime_search.utils.server_process import ServerProcess
from tests.probes import engine_fuzz

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

POST_ENDPOINTS = list(engine_fuzz.ENDPOINT_FIELDS)
# /flush_cache and the session calls take no body, as in SGLang, and ignore one.
BODY_ENDPOINTS = [path for path, fields in engine_fuzz.ENDPOINT_FIELDS.items() if fields]
# Fuzz bodies per endpoint: 200 take about 5 s; a longer fuzz is the tool's (docs/benchmarks/engine_fuzz.md).
FUZZ_REQUESTS = int(os.environ.get("SLIME_ENGINE_FUZZ_REQUESTS", "200"))


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    argv = ["-m", "slime_search.engines.cpu_engine_server", "--model-path", str(tiny_checkpoint), "--port", "0"]
    with ServerProcess([*argv, "--weight-version", "3"]) as process:
        yield process


def post(engine, path, content: bytes | None = None, **kwargs) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(f"{engine.url}{path}", content=content, headers=headers, timeout=60, **kwargs)


def message_of(response: httpx.Response) -> str:
    body = response.json()
    error = body.get("error", body)
    return str(error.get("message", error) if isinstance(error, dict) else error)


@pytest.mark.parametrize("path", BODY_ENDPOINTS)
@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"7", b"null"])
def test_a_body_that_is_not_an_object_gets_400_naming_the_endpoint(engine, path, body):
    response = post(engine, path, body)
    assert response.status_code == 400, response.text
    assert path in message_of(response) and "JSON object" in message_of(response)


@pytest.mark.parametrize(
    "sampling_params",
    [
        b'{"temperature": NaN}',
        b'{"temperature": Infinity}',
        b'{"top_p": 1e999}',
        b'{"max_new_tokens": 5.5}',
        b'{"top_k": 99999999999999999999999}',
        b'{"stop_token_ids": ["a"]}',
        b'{"ignore_eos": "yes"}',
    ],
)
def test_non_finite_and_mistyped_sampling_parameters_get_400(engine, sampling_params):
    body = b'{"input_ids": [1, 2], "sampling_params": ' + sampling_params + b"}"
    response = post(engine, "/generate", body)
    assert response.status_code == 400, response.text


def test_a_checkpoint_refused_by_weights_only_gets_400_and_the_old_weights_stay(engine, tiny_checkpoint, tmp_path):
    bad = tmp_path / "refused"
    bad.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoint / name, bad / name)
    # any global but torch's own is refused by torch.load(weights_only=True), which transformers uses
    torch.save({"model.embed_tokens.weight": argparse.Namespace(x=1)}, bad / "pytorch_model.bin")
    response = post(engine, "/update_weights_from_disk", json={"model_path": str(bad)})
    assert response.status_code == 400 and response.json()["success"] is False, response.text
    version = httpx.get(f"{engine.url}/model_info", timeout=30).json()["weight_version"]
    assert version == "3"
    assert engine_fuzz.greedy_tokens(engine.url)


class Call:
    """Pickles as the call fn(*args)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def payload(named: list) -> str:
    return base64.b64encode(pickle.dumps(named)).decode()


@pytest.mark.parametrize(
    "entry",
    [
        "not base64 !",
        base64.b64encode(b"\x80\x04junk").decode(),
        payload([("model.embed_tokens.weight", torch.zeros(2))]),  # a plain pickle, not shared memory
        payload({"a": 1}),
        # torch's rebuilders pass the payload allowlist; fed junk, they raise AttributeError or TypeError
        payload([("model.embed_tokens.weight", Call(reductions.rebuild_storage_fd, 1, 2, 3))]),
        payload([("model.embed_tokens.weight", Call(reductions.rebuild_storage_filename, 1, 2, 3, 4))]),
        payload([("model.embed_tokens.weight", Call(reductions.rebuild_tensor, 1, 2, 3))]),
        payload([("model.embed_tokens.weight", Call(torch.Size, "ab"))]),
    ],
    ids=["not-base64", "bad-pickle", "plain-pickle", "not-a-list", "storage-fd", "storage-file", "tensor", "size"],
)
def test_a_malformed_tensor_payload_gets_400(engine, entry):
    assert post(engine, "/begin_weight_update", b"{}").status_code == 200
    try:
        response = post(engine, "/update_weights_from_tensor", json={"serialized_named_tensors": [entry]})
    finally:
        post(engine, "/end_weight_update", b"{}")
    assert response.status_code == 400 and "serialized_named_tensors" in response.json()["message"], response.text


@pytest.mark.parametrize(
    "name, expected", [("no.such.weight", "no weights named"), ("model.embed_tokens.weight", "shape mismatch")]
)
def test_a_well_formed_payload_naming_no_weight_or_the_wrong_shape_gets_400(engine, name, expected):
    from slime_search.engines.weight_wire import serialize_named_tensors

    assert post(engine, "/begin_weight_update", b"{}").status_code == 200
    try:
        tensor = torch.zeros(3)  # kept alive until the engine has answered: it is read from shared memory
        entry = serialize_named_tensors([(name, tensor)])
        response = post(engine, "/update_weights_from_tensor", json={"serialized_named_tensors": [entry]})
    finally:
        post(engine, "/end_weight_update", b"{}")
    assert response.status_code == 400 and expected in response.json()["message"], response.text


def test_a_join_to_no_group_is_refused_before_any_rendezvous(engine):
    """Ranks out of range would make the engine host or wait for a rendezvous nobody serves."""
    body = {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 0, "world_size": 2}
    response = post(engine, "/init_weights_update_group", json=body)
    assert response.status_code == 400 and "rank_offset" in message_of(response)


def test_a_fuzz_of_every_endpoint_gets_no_5xx_and_the_engine_serves_after(engine, tiny_checkpoint):
    before = engine_fuzz.greedy_tokens(engine.url)
    counts = engine_fuzz.fuzz(engine.url, requests=FUZZ_REQUESTS, seed=7)
    print(engine_fuzz.table(counts))
    assert set(counts) == set(POST_ENDPOINTS)
    assert all(sum(tally.values()) == FUZZ_REQUESTS for tally in counts.values())
    assert {endpoint: tally.get("5xx", 0) + tally.get("no answer", 0) for endpoint, tally in counts.items()} == {
        endpoint: 0 for endpoint in POST_ENDPOINTS
    }
    # most bodies reach the checks (the rest: bodyless endpoints, bodies that happen to be valid)
    assert sum(tally.get("4xx", 0) for tally in counts.values()) > FUZZ_REQUESTS * len(POST_ENDPOINTS) // 2
    assert httpx.get(f"{engine.url}/health", timeout=30).status_code == 200
    engine_fuzz.restore(engine.url, str(tiny_checkpoint))
    assert engine_fuzz.greedy_tokens(engine.url) == before
    assert httpx.get(f"{engine.url}/model_info", timeout=30).json()["weight_version"] == "3"
