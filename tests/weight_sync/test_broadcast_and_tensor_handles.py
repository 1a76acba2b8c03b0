"""Weight sync without the disk, against the CPU engine server: broadcast (SGLang's weight-update group) over
gloo, tensor handles over shared memory, and the memory hand-over of a colocated trainer."""

import time

import httpx
import pytest
import torch

from megatron_bridge import iter_buckets
from slime_search.engines.weight_wire import dtype_from_name, dtype_name
from slime_search.utils.net import free_port
from slime_search.utils.server_process import ServerProcess
from slime_search.weight_sync.broadcast import BroadcastConfig, WeightBroadcaster, with_last
from slime_search.weight_sync.transport_base import weight_update_session

pytestmark = pytest.mark.timeout(300)
PROMPT = [151644, 872, 198, 9707, 1879, 0, 151645, 198, 151644, 77091, 198]


def test_with_last_marks_only_the_final_item():
    assert list(with_last("abc")) == [("a", False), ("b", False), ("c", True)]
    assert list(with_last([7])) == [(7, True)]
    assert list(with_last([])) == []


def test_dtype_names_are_the_ones_sglang_reads():
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_from_name("float32") is torch.float32
    with pytest.raises(ValueError, match="int64"):
        dtype_name(torch.int64)
    with pytest.raises(ValueError, match="unknown weight dtype"):
        dtype_from_name("torch.float32")


def engine_argv(checkpoint):
    argv = ["-m", "slime_search.engines.cpu_engine_server", "--model-path", str(checkpoint), "--port", "0"]
    return [*argv, "--weight-version", "0"]


def served_version(url: str) -> str:
    return httpx.get(f"{url}/model_info", timeout=30).json()["weight_version"]


@pytest.fixture(scope="module")
def checked_engine(tiny_checkpoint):
    """An engine that only ever receives refused requests (its weights stay at version 0)."""
    with ServerProcess(engine_argv(tiny_checkpoint)) as engine:
        yield engine


def generate(url: str, temperature: float = 1.0) -> dict:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 6, "temperature": temperature},
        "return_logprob": True,
    }
    return httpx.post(f"{url}/generate", json=body, timeout=60).json()


def log_probs_under(model, prompt: list[int], output_ids: list[int]) -> list[float]:
    tokens = prompt + output_ids
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([tokens])).logits[0], -1)
    return [lp[len(prompt) + i - 1, t].item() for i, t in enumerate(output_ids)]


def perturbed_state(checkpoint):
    """The tiny policy with every weight moved, as the HF state dict a trainer would push."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return model, state


@pytest.mark.slow
def test_two_engines_receive_every_bucket_and_serve_the_new_version(tiny_checkpoint):
    model, state = perturbed_state(tiny_checkpoint)
    with ServerProcess(engine_argv(tiny_checkpoint)) as first, ServerProcess(engine_argv(tiny_checkpoint)) as second:
        urls = [first.url, second.url]
        before = generate(first.url)
        broadcaster = WeightBroadcaster(BroadcastConfig("gloo", bucket_bytes=256 * 1024, timeout_s=120))
        broadcaster.connect(urls, [1, 1], "127.0.0.1", free_port())
        try:
            with weight_update_session(urls):
                assert broadcaster.push(state, "7") == ["7", "7"]
            for url in urls:
                out = generate(url)
                assert out["meta_info"]["weight_version"] == "7"
                engine_lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
                # the engine now samples from the pushed weights: its log-probs are theirs, not the old model's
                assert engine_lps == pytest.approx(log_probs_under(model, PROMPT, out["output_ids"]), abs=1e-4)
            old_lps = [lp for lp, _, _ in before["meta_info"]["output_token_logprobs"]]
            new_lps = log_probs_under(model, PROMPT, before["output_ids"])
            assert max(abs(a - b) for a, b in zip(old_lps, new_lps, strict=True)) > 1e-2
            assert len(list(iter_buckets(state.items(), 256 * 1024))) > 2  # the push really went in several buckets
        finally:
            broadcaster.close()
        for url in urls:  # the engines left the group
            answer = httpx.post(f"{url}/destroy_weights_update_group", json={}, timeout=30)
            assert answer.status_code == 400 and "not in weight-update group" in answer.text


def report_late(monkeypatch, delay_s: float) -> None:
    """Our side of each broadcast reports done `delay_s` after it ends, as a thread scheduled late on a busy machine
    does: the engine's answer then arrives first."""
    from slime_search.weight_sync import broadcast

    real = broadcast.broadcast_tensors

    def late(group, tensors):
        real(group, tensors)
        time.sleep(delay_s)

    monkeypatch.setattr(broadcast, "broadcast_tensors", late)


@pytest.mark.slow
def test_a_bad_bucket_is_refused_whole_and_the_group_stays_usable(tiny_checkpoint, monkeypatch):
    from slime_search.engines.client import EngineError

    _, state = perturbed_state(tiny_checkpoint)
    report_late(monkeypatch, 1.0)
    with ServerProcess(engine_argv(tiny_checkpoint)) as engine:
        before = generate(engine.url, temperature=0.0)
        broadcaster = WeightBroadcaster(BroadcastConfig("gloo", timeout_s=120))
        broadcaster.connect([engine.url], [1], "127.0.0.1", free_port())
        try:
            with weight_update_session([engine.url]):
                bad = {"model.norm.weight": state["model.norm.weight"], "model.not_a_layer.weight": torch.ones(3)}
                with pytest.raises(EngineError, match="no weights named model.not_a_layer.weight"):
                    broadcaster.push(bad, "1")
                assert served_version(engine.url) == "0"
                again = generate(engine.url, temperature=0.0)  # the refused bucket's valid tensor was not applied
                assert again["output_ids"] == before["output_ids"]
                assert again["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
                wrong_shape = {"model.norm.weight": torch.ones(5)}
                with pytest.raises(EngineError, match="shape mismatch"):
                    broadcaster.push(wrong_shape, "1")
                assert broadcaster.push(state, "2") == ["2"]
        finally:
            broadcaster.close()


@pytest.mark.slow
def test_a_bucket_refused_before_it_is_received_breaks_the_group_without_waiting_for_its_timeout(tiny_checkpoint):
    """Outside a weight-update session the engine refuses a bucket before receiving it (as SGLang does): our
    broadcast stays pending, so the push fails after the refusal grace, not the group's timeout, and the group is
    not used again."""
    from slime_search.engines.client import EngineError

    with ServerProcess(engine_argv(tiny_checkpoint)) as engine:
        # a group name of its own: a broken group stays registered in this process (its broadcast is still pending),
        # and a later test here connecting under the default name would be refused
        config = BroadcastConfig("gloo", timeout_s=120, group_name="refused_before_received", refusal_grace_s=2.0)
        broadcaster = WeightBroadcaster(config)
        broadcaster.connect([engine.url], [1], "127.0.0.1", free_port())
        try:
            large = {"model.embed_tokens.weight": torch.ones(64 * 1024**2 // 4)}  # more than the sockets buffer
            started = time.monotonic()
            with pytest.raises(EngineError, match="must run between begin_weight_update"):
                broadcaster.push(large, "1")
            assert time.monotonic() - started < 60 and broadcaster.broken
            with pytest.raises(RuntimeError, match="cannot be used again"):
                broadcaster.push(large, "1")
        finally:
            broadcaster.close()
        assert served_version(engine.url) == "0"


@pytest.mark.slow
def test_weight_update_group_requests_are_checked(checked_engine):
    engine = checked_engine
    nccl = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "nccl"}
    answer = httpx.post(f"{engine.url}/init_weights_update_group", json=nccl, timeout=30)
    assert answer.status_code == 400 and "over gloo" in answer.text
    missing = {"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2, "backend": "gloo"}
    answer = httpx.post(f"{engine.url}/init_weights_update_group", json=missing, timeout=30)
    assert answer.status_code == 400 and "'master_port'" in answer.text
    update = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}
    answer = httpx.post(f"{engine.url}/update_weights_from_distributed", json=update, timeout=30)
    assert answer.status_code == 400 and "/init_weights_update_group first" in answer.text
    assert generate(engine.url)["meta_info"]["weight_version"] == "0"  # still serving


@pytest.mark.slow
def test_an_engine_refusing_to_join_fails_the_connect_at_once(checked_engine):
    """Without the fast failure the trainer would wait out its 600 s rendezvous (past this module's timeout)."""
    from slime_search.engines.client import EngineError

    broadcaster = WeightBroadcaster(BroadcastConfig("nccl", timeout_s=600))
    with pytest.raises(EngineError, match="over gloo"):
        broadcaster.connect([checked_engine.url], [1], "127.0.0.1", free_port())
    assert broadcaster.group is None


def test_push_before_connect_is_an_error():
    with pytest.raises(RuntimeError, match="connect"):
        WeightBroadcaster(BroadcastConfig("gloo")).push({"w": torch.ones(2)}, "1")


# ---- tensor handles (SGLang's /update_weights_from_tensor) over shared memory ---------------------------------


def test_engine_payloads_follow_the_ranks_engines_sit_on():
    from slime_search.weight_sync.tensor_handles import engine_payloads

    assert engine_payloads(["a", "b", "c", None], [2, 1]) == [["a", "b"], ["c"]]
    with pytest.raises(ValueError, match="handles of 3 trainer ranks"):
        engine_payloads(["a", None, "c"], [2, 1])


def post_tensor_payload(url: str, entries, version=None) -> httpx.Response:
    body = {"serialized_named_tensors": entries, "load_format": None, "flush_cache": True}
    if version is not None:
        body["weight_version"] = version
    return httpx.post(f"{url}/update_weights_from_tensor", json=body, timeout=60)


class _RunsCommand:
    def __reduce__(self):
        import os

        return (os.system, ("true",))


@pytest.mark.slow
@pytest.mark.parametrize(
    "entries, message",
    [
        (["not base64 !"], "bad serialized_named_tensors entry"),
        (["a", "b"], "one serialized_named_tensors entry"),
        ("__pickle_of_code__", "refused posix.system"),
        ("__pickle_of_dict__", "list of (name, tensor) pairs"),
    ],
)
def test_tensor_payloads_are_checked_and_nothing_is_loaded(checked_engine, entries, message):
    import base64
    import pickle

    if entries == "__pickle_of_code__":
        entries = [base64.b64encode(pickle.dumps([("w", _RunsCommand())])).decode()]
    elif entries == "__pickle_of_dict__":
        entries = [base64.b64encode(pickle.dumps({"model.norm.weight": [1.0]})).decode()]
    with weight_update_session([checked_engine.url]):
        answer = post_tensor_payload(checked_engine.url, entries, "5")
    assert answer.status_code == 400 and message in answer.text
    assert served_version(checked_engine.url) == "0"


# ---- memory hand-over (SGLang's /release_memory_occupation and /resume_memory_occupation) ----------------------


@pytest.mark.slow
def test_released_weights_must_be_resumed_and_fully_updated_before_generating(tiny_checkpoint, tmp_path):
    from slime_search.engines.weight_wire import serialize_named_tensors

    model, state = perturbed_state(tiny_checkpoint)
    names = sorted(state)
    with ServerProcess(engine_argv(tiny_checkpoint)) as engine:

        def post(path, body):
            return httpx.post(f"{engine.url}{path}", json=body, timeout=60)

        assert post("/release_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
        assert generate(engine.url)["meta_info"]["weight_version"] == "0"  # weights kept: still serving
        assert post("/release_memory_occupation", {}).status_code == 200
        refused = httpx.post(f"{engine.url}/generate", json={"input_ids": PROMPT}, timeout=60)
        assert refused.status_code == 503 and "weights are released" in refused.text
        refused = post("/update_weights_from_disk", {"model_path": str(tiny_checkpoint)})
        assert refused.status_code == 400 and "resume_memory_occupation first" in refused.text
        assert post("/release_memory_occupation", {"tags": ["activations"]}).status_code == 400

        assert post("/resume_memory_occupation", {"tags": ["weights"]}).status_code == 200
        with weight_update_session([engine.url]):
            half = [(n, state[n]) for n in names[: len(names) // 2]]
            assert post_tensor_payload(engine.url, [serialize_named_tensors(half)]).status_code == 200
            refused = httpx.post(f"{engine.url}/generate", json={"input_ids": PROMPT}, timeout=60)
            assert refused.status_code == 503 and "have not been updated" in refused.text  # half the weights are 0
            state_now = httpx.get(f"{engine.url}/server_info", timeout=30).json()["internal_states"][0]
            assert state_now["released_memory"] == ["cuda_graph", "kv_cache"]
            assert state_now["weights_not_updated_since_resume"] == len(names) - len(names) // 2
            rest = [(n, state[n]) for n in names[len(names) // 2 :]]
            assert post_tensor_payload(engine.url, [serialize_named_tensors(rest)], "1").status_code == 200
        assert served_version(engine.url) == "1"
        assert post("/resume_memory_occupation", {"tags": ["kv_cache"]}).status_code == 200
        out = generate(engine.url)
        engine_lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert engine_lps == pytest.approx(log_probs_under(model, PROMPT, out["output_ids"]), abs=1e-4)
