"""The PEFT adapter folder this project writes (`save_peft_adapter`: --save-hf's `adapter/`, and
tools/convert_lora_to_hf.py) served by the pinned SGLang on CPU: loaded through /load_lora_adapter, and the same
adapters as tensors in shared memory through /load_lora_adapter_from_tensors (`weight_wire.serialize_named_tensors`),
each asked for by name and answering the log-probs PEFT computes on the HF model with the same adapters. Then
train.py against the same engine with --lora-sync-from-tensor: each push carries the adapters alone, and every
request of the next rollout is answered with them."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from safetensors.torch import load_file

from megatron_bridge import ModelShape
from slime_search.backends.megatron.lora_peft import save_peft_adapter
from slime_search.config.lora import LoraConfig
from slime_search.engines.weight_wire import serialize_named_tensors
from slime_search.utils.net import free_port
from slime_search.utils.server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RANK = 8


def random_adapters(shape: ModelShape, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Whole adapters on every Megatron projection, as `full_adapters` returns them: {path: (A [r, in], B [out, r])}."""
    gen = torch.Generator().manual_seed(seed)
    qkv_rows = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    sizes = {  # projection: (in, out)
        "self_attention.linear_qkv": (shape.hidden_size, qkv_rows),
        "self_attention.linear_proj": (shape.num_heads * shape.head_dim, shape.hidden_size),
        "mlp.linear_fc1": (shape.hidden_size, 2 * shape.ffn_hidden_size),
        "mlp.linear_fc2": (shape.ffn_hidden_size, shape.hidden_size),
    }
    return {
        f"decoder.layers.{layer}.{name}": (
            torch.randn(RANK, fan_in, generator=gen) * 0.2,
            torch.randn(fan_out, RANK, generator=gen) * 0.2,
        )
        for layer in range(shape.num_layers)
        for name, (fan_in, fan_out) in sizes.items()
    }


def input_log_probs(url: str, ids: list[int], lora: str | None) -> list[float]:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if lora is not None:
        body["lora_path"] = lora  # SGLang's field: the name an adapter was loaded under
    response = requests.post(f"{url}/generate", json=body, timeout=300)
    assert response.ok, response.text[:500]
    return [entry[0] for entry in response.json()["meta_info"]["input_token_logprobs"][1:]]


def hf_log_probs(model, ids: list[int]) -> list[float]:
    tokens = torch.tensor([ids])
    with torch.no_grad():
        logits = model(tokens).logits.log_softmax(-1)
    return logits[0, :-1].gather(-1, tokens[0, 1:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def lora_engine(tiny_checkpoint, tmp_path_factory):
    """The pinned SGLang on CPU serving the tiny policy, with LoRA adapters up to rank RANK on every projection."""
    from tests import sglang_cpu
    from tests.conftest import SGLangEngine

    log = tmp_path_factory.mktemp("lora_engine") / "engine.log"
    process = sglang_cpu.start_engine(tiny_checkpoint, free_port(), log_path=log, lora_rank=RANK)
    yield SGLangEngine(process, tiny_checkpoint)
    process.stop()


@pytest.fixture(scope="module")
def cpu_lora_engine(tiny_checkpoint):
    """The CPU engine server on the tiny policy (it serves LoRA adapters as SGLang does, always on)."""
    from tests.conftest import SGLangEngine

    argv = ["-m", "slime_search.engines.cpu_engine_server", "--model-path", str(tiny_checkpoint), "--port", "0"]
    with ServerProcess([*argv, "--max-wait-ms", "50", "--weight-version", "0"], health_path="/health_generate") as p:
        yield SGLangEngine(p, tiny_checkpoint)


def post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(f"{url}{path}", json=body, timeout=300)


@pytest.mark.parametrize("kind", ["sglang", "cpu"])
def test_the_engine_serves_the_peft_folder_as_peft_does(kind, request, tiny_checkpoint, tmp_path):
    """Both engines, the same assertions: the adapters from the folder and from tensors answer as PEFT, a request
    naming none as the base model, one naming an adapter never loaded (or unloaded) is refused with SGLang's words,
    and /update_weight_version sets the version /model_info reports."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    shape = ModelShape.from_hf_config(base.config)
    folder = tmp_path / "adapter"
    config = LoraConfig(lora_rank=RANK, lora_alpha=16.0)
    save_peft_adapter(folder, random_adapters(shape), shape, config, str(tiny_checkpoint))
    ids = list(range(3, 40))
    expected_base = hf_log_probs(base, ids)
    expected = hf_log_probs(PeftModel.from_pretrained(base, folder).eval(), ids)
    assert max(abs(a - b) for a, b in zip(expected, expected_base, strict=True)) > 0.1  # the adapters matter

    url = request.getfixturevalue("lora_engine" if kind == "sglang" else "cpu_lora_engine").url
    loaded = requests.post(f"{url}/load_lora_adapter", json={"lora_name": "from-folder", "lora_path": str(folder)})
    assert loaded.ok and loaded.json()["success"], loaded.text[:500]
    tensors = load_file(folder / "adapter_model.safetensors")  # alive until the engine has answered
    pushed = requests.post(
        f"{url}/load_lora_adapter_from_tensors",
        json={
            "lora_name": "from-tensors",
            "config_dict": json.loads((folder / "adapter_config.json").read_text()),
            "serialized_named_tensors": [serialize_named_tensors(tensors)],  # one entry per engine TP rank
        },
    )
    assert pushed.ok and pushed.json()["success"], pushed.text[:500]
    answers = {name: input_log_probs(url, ids, name) for name in ("from-folder", "from-tensors", None)}
    for name in ("from-folder", "from-tensors"):
        assert max(abs(a - b) for a, b in zip(answers[name], expected, strict=True)) < 1e-4, name
    assert max(abs(a - b) for a, b in zip(answers[None], expected_base, strict=True)) < 1e-4
    # batched together: requests of two adapters and of none, sent at once, each answered with its own model
    with ThreadPoolExecutor(6) as pool:
        mixed = list(pool.map(lambda name: input_log_probs(url, ids, name), ["from-folder", None, "from-tensors"] * 2))
    for name, got in zip(["from-folder", None, "from-tensors"] * 2, mixed, strict=True):
        want = expected_base if name is None else expected
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4, name

    again = post(url, "/load_lora_adapter", {"lora_name": "from-folder", "lora_path": str(folder)})
    assert again.status_code == 400 and "already loaded" in again.json()["error_message"]  # a name is loaded once
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, "lora_path": "never-loaded"}
    refused = post(url, "/generate", body)
    assert refused.status_code == 400
    assert "Got LoRA adapter that has never been loaded: never-loaded" in refused.json()["error"]["message"]
    for name in ("from-folder", "from-tensors"):
        unloaded = post(url, "/unload_lora_adapter", {"lora_name": name})
        assert unloaded.ok and unloaded.json()["success"], unloaded.text[:500]
    assert post(url, "/unload_lora_adapter", {"lora_name": "from-folder"}).status_code == 400  # none of that name
    updated = post(url, "/update_weight_version", {"new_version": "7", "abort_all_requests": False})
    assert updated.ok and updated.json()["success"]
    assert requests.get(f"{url}/model_info", timeout=30).json()["weight_version"] == "7"
    request.getfixturevalue("lora_engine" if kind == "sglang" else "cpu_lora_engine").reset()


def other_base(tmp_path):
    """A torch_dist folder of another tiny policy (other random weights, the same shape and tokenizer) than the HF
    folder the engines load: the adapters' base comes from --load."""
    from slime_search.models.tiny_qwen import TinyQwenConfig, save_tiny_checkpoint
    from tests.backends.test_megatron_convert import model_args, run_tool

    hf = save_tiny_checkpoint(tmp_path / "other_hf", TinyQwenConfig(seed=1))
    saved = run_tool(
        "convert_hf_to_torch_dist.py", *model_args("tiny-qwen2"), "--hf-checkpoint", str(hf),
        "--save", str(tmp_path / "other_td"),
    )  # fmt: skip
    assert saved.returncode == 0, saved.stderr[-3000:]
    return tmp_path / "other_td"


@pytest.mark.parametrize("kind", ["sglang", "cpu"])
def test_grpo_pushes_the_adapters_alone_and_the_engine_answers_every_request_with_them(
    kind, request, tiny_checkpoint, tmp_path
):
    """--lora-sync-from-tensor, with SGLang and with the CPU engine: after each step actor rank 0 hands the engine the
    adapters (PEFT names, shared memory), which replace the served adapter, and the version the engine reports is the
    step's. Step 1's rollout was sampled with the adapters pushed after step 0: the trainer gives its tokens the same
    log-probs, although the policy has moved from the base (KL > 0). A request that named no adapter would be
    answered by the base model. With the CPU engine the actor's base comes from --load, other weights than the HF
    folder the engine loads: the first push carries that base beneath the adapters (without it every log-prob
    differs)."""
    from tests.e2e.test_train_sglang import train_against

    engine = request.getfixturevalue("lora_engine" if kind == "sglang" else "cpu_lora_engine")
    flags = ["--lora-rank", str(RANK), "--lora-alpha", "16", "--lora-sync-from-tensor"]
    if kind == "cpu":
        flags += ["--load", str(other_base(tmp_path))]
    train = train_against(
        engine, tiny_checkpoint, tmp_path,
        "--num-rollout", "2", "--rollout-max-response-len", "8", "--max-response-tokens", "24",
        "--use-kl-loss", "--kl-loss-coef", "0.001", "--entropy-coef", "0.01", *flags,
    )  # fmt: skip
    assert [r["weight_version"] for r in train] == [1, 2]  # what the engine's /model_info reported after each push
    assert [r["rollout/weight_version"] for r in train] == [0, 1]
    diffs, kls = [r["train/train_rollout_logprob_abs_diff"] for r in train], [r["train/kl_loss"] for r in train]
    assert max(diffs) < 1e-3 and kls[1] > 100 * max(diffs), (diffs, kls)
    served = requests.get(f"{engine.url}/model_info", timeout=30).json()
    assert served["weight_version"] == "2"


def test_the_lora_push_benchmark_times_both_ways_at_its_smallest_size(lora_engine, tiny_checkpoint, capsys):
    """benchmarks/perf/lora_push.py against the same engine, one push each way: the folded weights (the engine's own, so
    it serves as before) and rank-8 adapters, each acknowledged by the version the engine then reports."""
    from benchmarks.perf.lora_push import main

    lora_engine.reset()
    assert (
        main(["--engine-url", lora_engine.url, "--model", str(tiny_checkpoint), "--rank", str(RANK), "--repeats", "1"])
        == 0
    )
    figures = json.loads(capsys.readouterr().out.splitlines()[-1])
    folded, adapters = figures["folded weights (tensor)"], figures[f"adapters alone, rank {RANK}"]
    assert 0 < adapters["bytes"] < 0.01 * folded["bytes"] and folded["median_s"] > 0 and adapters["median_s"] > 0
    lora_engine.reset()
