"""slime's own Search-R1 plugin (examples/search-r1/generate_with_search.py at slime 624b824, read from
../shared/compat), loaded by the flags slime users give and run by this project's rollout: against a scripted engine
and the real retriever (the searches reach it, the reward sees slime samples, the trainer's samples are right), and
against the CPU engine server and real SGLang on CPU (their sampled tokens and log-probs reach the trainer as the
engine gave them)."""

from __future__ import annotations

import json

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from local_dense_retriever import build_index
from local_dense_retriever.launch import RetrievalServerProcess
from slime_search.search_r1.prompt import make_row
from slime_search.utils.server_process import ServerProcess
from tests.compat.conftest import SEARCH_R1
from tests.retriever_helpers import write_tiny_corpus

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = {  # the scripted engine's turns, by a substring of the prompt
    "silver walrus": [
        "<think> I should look it up. </think>\n<search> silver walrus </search>",
        "<think> The passage says valley 54. </think>\n<answer> valley 54 </answer>",
    ],
    "blue lynx": ["I am not sure.", "<think> a guess </think>\n<answer> valley 3 </answer>"],
}
QUESTIONS = [("where does the silver walrus live", "valley 54"), ("where does the blue lynx live", "valley 10")]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The tiny corpus's BM25 retriever and a parquet of the two questions (Search-R1's schema)."""
    root = tmp_path_factory.mktemp("slime_plugin")
    write_tiny_corpus(root / "corpus.jsonl")
    index_args = ["--retriever-name", "bm25", "--corpus-path", str(root / "corpus.jsonl"), "--save-dir", str(root)]
    assert build_index.main(index_args) == 0
    rows = [make_row({"question": q, "golden_answers": [a]}, "nq", "train", i) for i, (q, a) in enumerate(QUESTIONS)]
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
    (root / "script.json").write_text(json.dumps(SCRIPT))
    with RetrievalServerProcess(
        "--retriever-name", "bm25", "--index-path", str(root / "bm25"), "--corpus-path", str(root / "corpus.jsonl")
    ) as retriever:
        yield root, retriever


@pytest.fixture
def slime_plugin(slime_files, slime_api, task, monkeypatch):
    """slime's generate_with_search module, importable as slime's run script makes it (PYTHONPATH), its local search
    pointed at the test retriever (slime users edit SEARCH_R1_CONFIGS in the file)."""
    import importlib

    monkeypatch.syspath_prepend(str(SEARCH_R1))
    module = importlib.import_module("generate_with_search")
    monkeypatch.setitem(module.SEARCH_R1_CONFIGS["local"], "search_url", f"{task[1].url}/retrieve")
    slime_api.misc.SingletonMeta._instances.pop(slime_api.sglang_rollout.GenerateState, None)
    yield module
    slime_api.misc.SingletonMeta._instances.pop(slime_api.sglang_rollout.GenerateState, None)


def run_slime_plugin(task, checkpoint, engine_url: str, *flags: str, generate: str = "generate_with_search.generate"):
    """The command line slime users give, parsed by this project's CLI; one rollout by the rollout manager's code.
    Returns (groups, the trainer's batch, the plugin args)."""
    from slime_search.arguments import parse_args
    from slime_search.engines.deployment import Engines
    from slime_search.plugins import Plugins
    from slime_search.rollout.data_source import DataSource
    from slime_search.rollout.manager import plugin_args_for, run_rollout, train_batch
    from slime_search.run.config import rollout_manager_config

    root, _ = task
    args = parse_args(
        ["--hf-checkpoint", str(checkpoint), "--save", str(root / "run"), "--num-rollout", "1", "--prompt-data", str(root / "train.parquet"), "--input-key", "prompt",
         "--label-key", "reward_model", "--apply-chat-template", "--rollout-batch-size", "2",
         "--n-samples-per-prompt", "2", "--custom-generate-function-path", generate,
         "--custom-rm-path", "generate_with_search.reward_func", *flags]
    )  # fmt: skip
    config = rollout_manager_config(args, None)
    plugin_args = plugin_args_for(args, Engines(engine_url, [engine_url]))
    plugins = Plugins.load(config.generate_path, config.reward_path)
    groups, metrics = run_rollout(plugins, plugin_args, DataSource(config.data), config.rollout, config.sampling_params)
    return groups, train_batch(groups, config.rollout, metrics, examples=4), plugin_args


def spans(sample) -> list[tuple[int, int, int]]:
    from slime_search.compat.samples import runs

    return runs(sample.loss_mask)


def test_slimes_search_plugin_searches_through_the_retriever_and_trains_as_slime_means(
    slime_plugin, slime_api, task, tiny_checkpoint
):
    from transformers import AutoTokenizer

    from slime_search.types import Sample, Status

    with pytest.raises(TypeError, match="instance of Sample"):  # slime's reward refuses anything but slime's sample
        import asyncio

        asyncio.run(slime_plugin.reward_func(None, Sample(prompt="p", response="r")))
    argv = ["-m", "benchmarks.harness.stand_in_engines.replay", "--tokenizer", str(tiny_checkpoint),
            "--script", str(task[0] / "script.json"), "--port", "0"]  # fmt: skip
    with ServerProcess(argv) as engine:
        groups, batch, plugin_args = run_slime_plugin(
            task, tiny_checkpoint, engine.url, "--rollout-max-response-len", "64"
        )
        requests = httpx.get(f"{engine.url}/requests").json()
    assert (plugin_args.sglang_router_ip, plugin_args.sglang_router_port) == (
        "127.0.0.1",
        int(engine.url.rsplit(":", 1)[1]),
    )
    assert all("text" in r and r["sampling_params"]["no_stop_trim"] is True for r in requests)  # slime's payload

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    walrus, lynx = groups  # by prompt, n = 2 each
    for sample in walrus:
        # the retriever's passage, as slime's plugin formats it, between the two model turns
        assert 'Doc 1(Title: "Silver Walrus") The silver walrus lives in valley number 54' in sample.response
        assert isinstance(sample.slime_sample, slime_api.types.Sample) and sample.status is Status.COMPLETED
        assert sample.reward == 1.0  # EM of "valley 54" in a valid Search-R1 trajectory
        generated, observed, answer = spans(sample)
        assert (generated[2], observed[2], answer[2]) == (1, 0, 1)
        assert tokenizer.decode(sample.response_tokens[observed[0] : observed[1]]).startswith("\n\n<information>")
    for sample in lynx:  # an invalid first turn, slime's correction, then a wrong answer
        assert "My previous action is invalid." in sample.response and sample.reward == 0.0
    # the second request of a walrus trajectory carried the retrieved passage back to the engine
    assert any("lives in valley number 54" in r["text"] for r in requests)

    samples = [s for g in groups for s in g]
    assert len(batch.samples) == 4 and batch.metrics["rollout/reward_mean"] == 0.5
    for sample, train in zip(samples, batch.samples, strict=True):
        text = tokenizer.apply_chat_template(sample.prompt, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        assert train.tokens[: len(prompt_ids)] == list(prompt_ids)
        assert train.response_length == len(train.tokens) - len(prompt_ids) == len(train.loss_mask)
        assert train.loss_mask == sample.slime_sample.loss_mask
        for start, stop, generated in spans(sample):
            expected = [round(-0.01 * (i + 1), 6) for i in range(stop - start)] if generated else [0.0] * (stop - start)
            assert [round(lp, 6) for lp in train.rollout_log_probs[start:stop]] == expected  # the engine's, per turn
            assert set(train.token_versions[start:stop]) == ({7} if generated else {-1})
        assert train.advantage == 0.0  # both samples of each group scored alike
    assert batch.examples[0]["segments"][0] == [sample_text(tokenizer, samples[0], 0), True]


def sample_text(tokenizer, sample, span: int) -> str:
    start, stop, _ = spans(sample)[span]
    return tokenizer.decode(sample.response_tokens[start:stop])


def test_slimes_plugins_run_on_the_cpu_engine_server(slime_plugin, slime_api, task, tiny_checkpoint):
    """The CPU engine samples from the tiny policy: slime's plugin and slime's default generate hand the trainer its
    tokens and log-probs as the engine returned them (a random policy's turns run to the length limit)."""
    argv = ["-m", "slime_search.engines.cpu_engine_server", "--model-path", str(tiny_checkpoint), "--port", "0",
            "--weight-version", "0"]  # fmt: skip
    with ServerProcess(argv) as engine:
        searched, searched_batch, _ = run_slime_plugin(
            task, tiny_checkpoint, engine.url, "--rollout-max-response-len", "6"
        )
        single, single_batch, _ = run_slime_plugin(
            task, tiny_checkpoint, engine.url, "--rollout-max-response-len", "6",
            generate="slime.rollout.sglang_rollout.generate",
        )  # fmt: skip
    assert_the_trainer_gets_what_the_engine_sampled(searched, searched_batch)
    assert_the_trainer_gets_what_the_engine_sampled(single, single_batch)


def test_slimes_search_plugin_runs_unchanged_on_real_sglang(slime_plugin, task, tiny_checkpoint, sglang_engine):
    """The same plugin against SGLang 0.5.23 on CPU (tests/sglang_cpu): slime's payload is SGLang's own API, and the
    tokens and log-probs SGLang returns reach the trainer as it returned them."""
    sglang_engine.reset()
    groups, batch, plugin_args = run_slime_plugin(
        task, tiny_checkpoint, sglang_engine.url, "--rollout-max-response-len", "6"
    )
    assert f"http://{plugin_args.sglang_router_ip}:{plugin_args.sglang_router_port}" == sglang_engine.url
    assert_the_trainer_gets_what_the_engine_sampled(groups, batch)


def assert_the_trainer_gets_what_the_engine_sampled(groups, batch) -> None:
    """Every sample's slime view is what the trainer trains on, its generated tokens carrying the engine's (negative)
    log-probs and its weight version 0."""
    samples = [s for g in groups for s in g]
    assert len(batch.samples) == len(samples) == 4
    for sample, train in zip(samples, batch.samples, strict=True):
        view = sample.slime_sample
        assert train.tokens == view.tokens and train.loss_mask == view.loss_mask
        assert train.rollout_log_probs == view.rollout_log_probs
        generated = [lp for lp, m in zip(train.rollout_log_probs, train.loss_mask, strict=True) if m]
        assert generated and all(lp < 0 for lp in generated)  # the engine's log-probs of what it sampled
        assert sample.status.value == view.status.value in ("truncated", "completed")
        assert set(train.token_versions) <= {0, -1} and 0 in train.token_versions  # the engine's version 0
        assert sample.reward is not None
