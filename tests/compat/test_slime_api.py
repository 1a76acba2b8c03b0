"""slime's plugin API as this project serves it without slime: the import hook, slime's Sample (its fields, statuses
and append_response_tokens, held to slime's own file), post's retries against a real server, GenerateState,
slime's default generate and the context-parallel helpers at size 1."""

from __future__ import annotations

import ast
import asyncio
import base64
import dataclasses
import inspect
import logging
import os
import subprocess
import sys
from argparse import Namespace

import httpx
import pytest
import torch

from slime_search.utils.server_process import ServerProcess
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(120)


def slime_class(slime_files, name: str) -> ast.ClassDef:
    tree = ast.parse((slime_files / "slime" / "utils" / "types.py").read_text())
    return next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name)


def default_of(node: ast.expr, sample_class):
    """The default a field of slime's file declares, as a value (field(default_factory=X) -> X())."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "field":
        factory = ast.unparse(node.keywords[0].value)
        return {"list": [], "dict": {}, "SpecInfo": sample_class.SpecInfo(), "PrefixCacheInfo": sample_class.PrefixCacheInfo()}[factory]  # fmt: skip
    if ast.unparse(node) == "Status.PENDING":
        return sample_class.Status.PENDING
    return ast.literal_eval(node)


def test_sample_has_slimes_fields_defaults_statuses_and_append_signature(slime_files, slime_api):
    Sample = slime_api.types.Sample
    declared = [node for node in slime_class(slime_files, "Sample").body if isinstance(node, ast.AnnAssign)]
    assert [f.name for f in dataclasses.fields(Sample)] == [node.target.id for node in declared]
    fresh = Sample()
    for node in declared:
        assert getattr(fresh, node.target.id) == default_of(node.value, Sample), node.target.id

    status = next(
        n for n in slime_class(slime_files, "Sample").body if isinstance(n, ast.ClassDef) and n.name == "Status"
    )
    members = {n.targets[0].id: n.value.value for n in status.body if isinstance(n, ast.Assign)}
    assert {m.name: m.value for m in Sample.Status} == members == {
        "PENDING": "pending", "COMPLETED": "completed", "TRUNCATED": "truncated", "ABORTED": "aborted", "FAILED": "failed"
    }  # fmt: skip
    from slime_search.types import Status

    assert Sample.Status is Status  # the project's own statuses: no mapping between the two

    method = next(
        n for n in slime_class(slime_files, "Sample").body
        if isinstance(n, ast.FunctionDef) and n.name == "append_response_tokens"
    )  # fmt: skip
    ours = inspect.signature(Sample.append_response_tokens).parameters
    theirs = [a.arg for a in method.args.args] + [a.arg for a in method.args.kwonlyargs]
    assert list(ours) == theirs
    kwonly_defaults = [ast.literal_eval(d) for d in method.args.kw_defaults]
    assert [ours[a.arg].default for a in method.args.kwonlyargs] == kwonly_defaults
    assert all(ours[a.arg].kind is inspect.Parameter.KEYWORD_ONLY for a in method.args.kwonlyargs)


def test_append_response_tokens_keeps_tokens_mask_log_probs_and_status_aligned(slime_api):
    Sample = slime_api.types.Sample
    sample = Sample(prompt="p", tokens=[1, 2])
    meta = {"finish_reason": {"type": "stop"}, "weight_version": "4", "cached_tokens": 1, "prompt_tokens": 2}
    sample.append_response_tokens(None, tokens=[3, 4], log_probs=[-0.5, -0.25], meta_info=meta, text="ab")
    sample.append_response_tokens(None, tokens=torch.tensor([5, 6, 7]), trainable=False, text="obs")
    sample.append_response_tokens(
        None, tokens=[8], log_probs=torch.tensor([-1.0]), meta_info={"finish_reason": {"type": "length"}}, text="c"
    )
    assert sample.tokens == [1, 2, 3, 4, 5, 6, 7, 8] and sample.response_length == 6 and sample.response == "abobsc"
    assert sample.loss_mask == [1, 1, 0, 0, 0, 1]
    assert sample.rollout_log_probs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert sample.status is Sample.Status.TRUNCATED  # the last finish reason
    assert sample.weight_versions == ["4"]  # only meta_info that says it
    assert (sample.prefix_cache_info.cached_tokens, sample.prefix_cache_info.total_prompt_tokens) == (1, 2)
    assert sample.effective_response_length == 3

    unmasked = Sample(tokens=[1, 2, 3], response_length=2)  # a response given whole, without a mask: all trained
    unmasked.append_response_tokens(tokens=[9], trainable=False)
    assert unmasked.loss_mask == [1, 1, 0] and unmasked.rollout_log_probs == [0.0, 0.0, 0.0]

    with pytest.raises(ValueError, match="require rollout log probabilities"):
        Sample().append_response_tokens(tokens=[1])
    with pytest.raises(ValueError, match="should not pass rollout log probabilities"):
        Sample().append_response_tokens(tokens=[1], log_probs=[0.0], trainable=False)
    with pytest.raises(ValueError, match="log_probs length 1 != tokens length 2"):
        Sample().append_response_tokens(tokens=[1, 2], log_probs=[0.0])
    with pytest.raises(ValueError, match="no existing rollout_log_probs"):
        Sample(tokens=[1, 2], response_length=1).append_response_tokens(tokens=[3], log_probs=[0.0])


def int32_base64(values: list[int]) -> str:
    return base64.b64encode(torch.tensor(values, dtype=torch.int32).numpy().tobytes()).decode()


def test_top_p_replay_spans_are_merged_and_padded_for_tool_tokens(slime_api):
    Sample = slime_api.types.Sample
    sample = Sample(tokens=[0])
    first = {"top_p_token_ids": int32_base64([5, 6, 7]), "top_p_token_offsets": [0, 2, 3]}  # two tokens: {5,6}, {7}
    sample.append_response_tokens(tokens=[5, 7], log_probs=[-0.1, -0.2], meta_info=first)
    sample.append_response_tokens(tokens=[1, 1], trainable=False)  # tool tokens: empty spans
    sample.append_response_tokens(
        tokens=[9], log_probs=[-0.3], meta_info={"top_p_kept_token_ids": [9], "top_p_kept_token_offsets": [0, 1]}
    )
    assert sample.rollout_top_p_token_ids.tolist() == [5, 6, 7, 9]
    assert sample.rollout_top_p_token_offsets.tolist() == [0, 2, 3, 3, 3, 4]
    with pytest.raises(ValueError, match="offsets length must equal generated token count"):
        Sample().append_response_tokens(tokens=[5], log_probs=[0.0], meta_info=first)
    with pytest.raises(ValueError, match="routed-experts replay"):
        Sample().append_response_tokens(tokens=[5], log_probs=[0.0], meta_info={"routed_experts": [1, 2]})

    sample.extra = "kept"  # slime's to_dict carries a plugin's own attributes, and from_dict restores them
    again = Sample.from_dict(sample.to_dict())
    assert again.extra == "kept" and again.status is sample.status and again.tokens == sample.tokens
    assert sample.to_dict()["status"] == "pending" and sample.to_dict()["spec_info"]["spec_verify_ct"] == 0


@pytest.fixture(scope="module")
def flaky_server():
    """A real HTTP server on 127.0.0.1 whose /generate fails on cue (tests/search_r1/serper_standin.py)."""
    with ServerProcess(
        [str(REPO_ROOT / "tests" / "search_r1" / "serper_standin.py"), "--port", "0", "--api-key", "k"]
    ) as server:
        yield server


def run_and_close(http_utils, coroutine):
    async def go():
        try:
            return await coroutine
        finally:
            await http_utils.close_http_client()

    return asyncio.run(go())


def test_post_retries_every_failure_then_answers_or_raises_the_last(slime_api, flaky_server, caplog):
    http_utils = slime_api.http_utils
    url = f"{flaky_server.url}/generate"
    with caplog.at_level(logging.INFO, logger=http_utils.__name__):
        answer = run_and_close(http_utils, http_utils.post(url, {"input_ids": [503, 2]}))
    assert answer["output_ids"] == [7] and answer["meta_info"]["finish_reason"]["type"] == "length"
    calls = httpx.get(f"{flaky_server.url}/generate_calls").json()
    assert calls["503,2"] == 3  # two 503s, then the answer
    assert "retrying... (attempt 1/60" in caplog.text and "attempt 2/60" in caplog.text

    with pytest.raises(http_utils.HTTPStatusError, match="HTTP 500") as failed:
        run_and_close(http_utils, http_utils.post(url, {"input_ids": [500, 0]}, max_retries=2))
    assert "failing on cue" in failed.value.text
    assert httpx.get(f"{flaky_server.url}/generate_calls").json()["500,0"] == 2
    # an answer that is not JSON comes back as its text; get() reads JSON
    garbled = run_and_close(http_utils, http_utils.post(f"{flaky_server.url}/retrieve", {"queries": ["garbled"]}))
    assert isinstance(garbled, str) and garbled
    assert run_and_close(http_utils, http_utils.get(f"{flaky_server.url}/health"))["ok"] is True


def test_post_names_the_served_adapter_in_every_generate_that_names_none(slime_api, flaky_server):
    """Under --lora-sync-from-tensor the engines serve the policy as an adapter (the plugins' `args.lora_path`), and a
    slime plugin builds its /generate payload itself: post adds the adapter's name, so no request reaches the base."""
    http_utils = slime_api.http_utils
    url = f"{flaky_server.url}/generate"
    try:
        http_utils.init_http_client(Namespace(lora_path="policy", rollout_num_engines=1))
        payload = {"input_ids": [0, 0]}
        assert run_and_close(http_utils, http_utils.post(url, payload))["meta_info"]["lora_path"] == "policy"
        assert payload == {"input_ids": [0, 0]}  # the plugin's own dict is left as it was
        named = {"input_ids": [0, 0], "lora_path": "other"}
        assert run_and_close(http_utils, http_utils.post(url, named))["meta_info"]["lora_path"] == "other"
        assert http_utils.with_adapter(f"{flaky_server.url}/retrieve", {"queries": ["q"]}) == {"queries": ["q"]}
    finally:
        http_utils.init_http_client(Namespace(rollout_num_engines=1))
    assert run_and_close(http_utils, http_utils.post(url, {"input_ids": [0, 0]}))["meta_info"]["lora_path"] is None


def slime_flag_args(checkpoint, **overrides) -> Namespace:
    from slime_search.compat.boundary import SLIME_DEFAULTS

    flags = dict(
        hf_checkpoint=str(checkpoint), rollout_temperature=0.7, rollout_top_p=1.0, rollout_max_response_len=64,
        n_samples_per_prompt=2, rollout_seed=1, rollout_num_engines=1, sglang_router_ip="127.0.0.1",
        sglang_router_port=1,
    )  # fmt: skip
    return Namespace(**{**SLIME_DEFAULTS, **flags, **overrides})


def test_generate_state_is_slimes_singleton_with_the_tokenizer_and_sampling_params(slime_api, tiny_checkpoint):
    rollout, misc = slime_api.sglang_rollout, slime_api.misc
    misc.SingletonMeta._instances.pop(rollout.GenerateState, None)
    try:
        state = rollout.GenerateState(slime_flag_args(tiny_checkpoint, rollout_stop=["</answer>"]))
        assert state.tokenizer.encode("hello", add_special_tokens=False)
        assert state.sampling_params == {
            "temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_new_tokens": 64, "stop": ["</answer>"],
            "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
            "spaces_between_special_tokens": False,
        }  # fmt: skip
        assert rollout.GenerateState(Namespace()) is state  # slime's singleton: later arguments do not matter

        async def hold():
            async with state.semaphore:
                return state.semaphore._value

        # a fresh event loop per rollout, as this project runs them: the semaphore is the loop's own
        assert asyncio.run(hold()) == asyncio.run(hold()) == 512 - 1
    finally:
        misc.SingletonMeta._instances.pop(rollout.GenerateState, None)


def test_slimes_default_generate_appends_the_engines_tokens(slime_api, flaky_server, tiny_checkpoint):
    rollout, types_ = slime_api.sglang_rollout, slime_api.types
    misc = slime_api.misc
    misc.SingletonMeta._instances.pop(rollout.GenerateState, None)
    host, port = flaky_server.url.removeprefix("http://").split(":")
    args = slime_flag_args(tiny_checkpoint, sglang_router_ip=host, sglang_router_port=int(port))
    try:
        sample = types_.Sample(tokens=[0, 0])  # the stand-in engine: input_ids [0, 0] never fail
        out = run_and_close(slime_api.http_utils, rollout.generate(args, sample, {"max_new_tokens": 4}))
    finally:
        misc.SingletonMeta._instances.pop(rollout.GenerateState, None)
    assert out.tokens == [0, 0, 7] and out.rollout_log_probs == [-0.5] and out.loss_mask == [1]
    assert out.response == "x" and out.status is types_.Sample.Status.TRUNCATED
    assert rollout.get_model_url(args, "ref") == f"http://{host}:{port}/generate"


def test_context_parallel_helpers_at_size_one(slime_api):
    cp = slime_api.cp_utils
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    assert cp.all_gather_with_cp(values, 9, 5) is values
    assert cp.slice_log_prob_with_cp([0.1, 0.2], 5, 2) == [0.1, 0.2]
    with pytest.raises(ValueError, match="3 values for a response of 2"):
        cp.slice_log_prob_with_cp([0.1, 0.2, 0.3], 5, 2)
    masks = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0])]
    # per sample: (1 + 2) / 2 + (4 + 5) / 2 = 6; per token: 3 + 9 = 12
    assert cp.get_sum_of_sample_mean([5, 4], [3, 2], masks)(values).item() == pytest.approx(6.0)
    assert cp.get_sum_of_sample_mean([5, 4], [3, 2], masks, True)(values).item() == pytest.approx(12.0)


FINDER_PROBE = """
import importlib, importlib.util, logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s", stream=sys.stdout)
from slime_search.plugins import load_function
try:
    load_function("probe_plugin.generate")
except Exception as err:
    print("LOAD FAILED", err)
importlib.util.find_spec("slime")
import slime, slime.utils.types
print("SLIME", slime.__file__)
"""


def run_probe(tmp_path, with_real_slime: bool) -> str:
    tmp_path.mkdir(parents=True)
    (tmp_path / "probe_plugin.py").write_text("from slime.utils.types import Sample\n\nasync def generate(*a): ...\n")
    if with_real_slime:  # a stand-in for an installed slime: it must win
        (tmp_path / "slime" / "utils").mkdir(parents=True)
        (tmp_path / "slime" / "__init__.py").write_text("")
        (tmp_path / "slime" / "utils" / "__init__.py").write_text("")
        (tmp_path / "slime" / "utils" / "types.py").write_text("class Sample:\n    pass\n")
    done = subprocess.run(
        [sys.executable, "-c", FINDER_PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO_ROOT}"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_import_hook_serves_slime_once_announced_and_never_over_a_real_slime(tmp_path):
    served = run_probe(tmp_path / "bare", with_real_slime=False)
    assert "LOAD FAILED" not in served and "slime_search/compat/slime/__init__.py" in served
    assert served.count("slime is not installed") == 1, served  # once, though asked twice

    real = run_probe(tmp_path / "real", with_real_slime=True)
    assert f"SLIME {tmp_path / 'real' / 'slime' / '__init__.py'}" in real and "slime is not installed" not in real
