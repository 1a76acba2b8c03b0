"""The engine contract on Qwen3: the contract's tests of generation, stop handling and every weight update, run on
the tiny Qwen3 (q/k RMSNorm, no q/k/v bias, its own head size, Qwen3's tokenizer) against real SGLang and the CPU
engine. A q/k norm a transport left behind, or a head size taken from hidden / heads, would part the served
log-probs from HF's."""

import shutil

import httpx
import pytest

from slime_search.models.tiny_qwen import TinyQwenConfig, save_tiny_checkpoint
from tests.conftest import reset_engine
from tests.engines.test_engine_contract import (  # noqa: F401 - collected here with this module's Qwen3 fixtures
    cpu_engine_url,
    generate,
    test_broadcast_updates_over_gloo_inside_a_session_and_a_refused_bucket_fails_at_once,
    test_generate_answers_ids_log_probs_and_finish_reason,
    test_stop_strings_and_stop_tokens_end_with_the_stop_kept_in_ids_and_trimmed_from_text,
    test_tensor_updates_must_sit_in_a_weight_update_session,
    test_update_weights_from_disk_answers_success_and_model_info_the_new_version,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_qwen3_checkpoint):
    """What the contract's tests serve and compare against: here the tiny Qwen3."""
    return tiny_qwen3_checkpoint


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory):
    """The tiny Qwen3 architecture with other weights: what a trainer pushes."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_seed1"), TinyQwenConfig(family="qwen3", seed=1))


@pytest.fixture(params=["cpu_engine", pytest.param("sglang", marks=pytest.mark.session_engine)])
def engine(request, tiny_checkpoint) -> str:
    """An engine serving the tiny Qwen3 at weight version "0"."""
    if request.param == "cpu_engine":
        url = request.getfixturevalue("cpu_engine_url")
    else:
        url = request.getfixturevalue("sglang_qwen3_engine").url
    reset_engine(url, tiny_checkpoint)
    return url


def test_the_contract_runs_here_on_qwen3(tiny_checkpoint, other_checkpoint):
    """The fixtures the imported tests get in this module are Qwen3's."""
    import json

    for checkpoint in (tiny_checkpoint, other_checkpoint):
        config = json.loads((checkpoint / "config.json").read_text())
        assert (
            config["model_type"] == "qwen3"
            and config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]
        )


def says_only(checkpoint, token: int, out_dir):
    """The tiny Qwen3 rewired to answer `token` first, whatever it is asked: every embedding carries a constant C in
    dimension 0, which then dominates the residual stream; the final norm reads only that dimension; and the
    token's own embedding (tied to the output layer) has 2C there, so its logit leads every other token's by about
    C * sqrt(hidden size) = 80."""
    import torch
    from transformers import AutoModelForCausalLM

    shutil.copytree(checkpoint, out_dir)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding[:, 0] = 10.0
        embedding[token, 0] = 20.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


@pytest.mark.parametrize("token", [151645, 151643], ids=["im_end", "endoftext"])
def test_both_of_qwen3s_end_tokens_end_a_generation(engine, tiny_checkpoint, tmp_path, token):
    """The served checkpoint's generation config names both of the published Qwen3's end tokens, and the engine stops
    at either with no stop token asked for: a model that says <|endoftext|> first gets just that back, finished by a
    stop, not eight tokens cut by the length limit."""
    path = says_only(tiny_checkpoint, token, tmp_path / "says_only")
    body = {"model_path": str(path), "weight_version": "1"}
    answer = httpx.post(f"{engine}/update_weights_from_disk", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    out = generate(engine, sampling_params={"max_new_tokens": 8, "temperature": 0.0})
    assert out["output_ids"] == [token]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
