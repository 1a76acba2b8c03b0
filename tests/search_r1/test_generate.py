"""The Search-R1 generate plugin: the multi-turn loop over real HTTP, token streams and masks."""

import asyncio
import json

import httpx
import pytest

from local_dense_retriever import build_index
from local_dense_retriever.launch import RetrievalServerProcess
from slime_search.search_r1.config import search_r1_args
from slime_search.search_r1.generate import INVALID_ACTION, close_resources, generate, parse_action
from slime_search.search_r1.prompt import make_prompt
from slime_search.search_r1.reward import RewardConfig, qa_em_format_score, reward_func
from slime_search.types import Sample, Status
from slime_search.utils.server_process import ServerProcess
from tests.retriever_helpers import write_tiny_corpus

pytestmark = pytest.mark.timeout(300)

SCRIPT = {
    "silver walrus": [
        "<think> I should look it up. </think>\n<search> silver walrus </search>",
        "<think> The passage says valley 54. </think>\n<answer> valley 54 </answer>",
    ],
    "blue lynx": [
        "I am not sure what to do here.",
        "<think> let me answer </think> <answer> valley 10 </answer>",
    ],
    "red heron": ["<think> search again </think>\n<search> red heron </search>"],
    "green otter": ["<think> I will just stop.<|im_end|>", "<answer> valley 54 </answer>"],
    "brown hare": ["<think> " + "rambling on and on " * 30, "<answer> valley 54 </answer>"],
    # Qwen2 merges ">." and ">\n\n" into the token that completes the tag
    "pink crab": [
        "<think> look </think>\n<search> pink crab </search>\n\nmore",
        "<think> found it </think>\n<answer> valley 54 </answer>.",
    ],
    "teal newt": ["<think> a<|im_start|> b </think>\n<answer> valley 54 </answer>"],
    "olive toad": ["<search> olive </answer> toad </search>", "<answer> valley 54 </answer>"],
    "gold eagle": ["<think> I know it </think>\n<answer> valley 54 </answer> <search> gold eagle </search>"],
    "black bison": ["<think> " + "very long thinking " * 40 + "</think>\n<answer> x </answer>"],
    "white crane": ["<think> nothing to ask </think>\n<search> </search>", "<answer> valley 3 </answer>"],
    "grey mole": ["<search> no-contents </search>", "<answer> valley 3 </answer>"],
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_checkpoint):
    root = tmp_path_factory.mktemp("generate")
    write_tiny_corpus(root / "corpus.jsonl")
    assert (
        build_index.main(
            ["--retriever-name", "bm25", "--corpus-path", str(root / "corpus.jsonl"), "--save-dir", str(root)]
        )
        == 0
    )
    (root / "script.json").write_text(json.dumps(SCRIPT))
    engine_argv = [
        "-m",
        "benchmarks.harness.stand_in_engines.replay",
        "--tokenizer",
        str(tiny_checkpoint),
        "--script",
        str(root / "script.json"),
        "--port",
        "0",
    ]
    with (
        RetrievalServerProcess(
            "--retriever-name", "bm25", "--index-path", str(root / "bm25"), "--corpus-path", str(root / "corpus.jsonl")
        ) as retriever,
        ServerProcess(engine_argv) as engine,
    ):
        yield retriever, engine


def make_args(servers, tiny_checkpoint, **overrides):
    retriever, engine = servers
    base = dict(
        engine_url=engine.url,
        hf_checkpoint=str(tiny_checkpoint),
        search_url=f"{retriever.url}/retrieve",
        apply_chat_template=True,
    )
    return search_r1_args(**{**base, **overrides})


def run(args, question, sampling_params=None):
    sample = Sample(prompt=make_prompt(question), label={"target": ["valley 54", "silver walrus"]})

    async def go():
        try:
            return await generate(args, sample, sampling_params or {"temperature": 1.0, "max_new_tokens": 200})
        finally:
            await close_resources()

    return asyncio.run(go())


def spans(sample):
    """(mask, text) runs of the response, to read the trajectory the way the trainer sees it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sample.metadata["tokenizer"])
    out, start = [], 0
    response = sample.response_tokens
    for i in range(1, len(response) + 1):
        if i == len(response) or sample.loss_mask[i] != sample.loss_mask[start]:
            out.append((sample.loss_mask[start], tokenizer.decode(response[start:i])))
            start = i
    return out


def test_parse_action():
    assert parse_action("<think>x</think><search> q1 </search> <answer>a</answer>") == ("search", "q1")
    assert parse_action("<answer>\nParis\n</answer>") == ("answer", "Paris")
    assert parse_action("<search>unfinished") == (None, "")


def test_search_then_answer(servers, tiny_checkpoint):
    sample = run(make_args(servers, tiny_checkpoint), "Where does the silver walrus live")
    sample.metadata["tokenizer"] = str(tiny_checkpoint)
    assert sample.status is Status.COMPLETED and sample.metadata["finish_reason"] == "answer"
    assert sample.metrics["turns"] == 2 and sample.metrics["searches"] == 1 and sample.metrics["invalid_actions"] == 0
    runs = spans(sample)
    assert [mask for mask, _ in runs] == [1, 0, 1]
    assert runs[0][1] == SCRIPT["silver walrus"][0]
    assert runs[1][1].startswith(
        '\n\n<information>Doc 1(Title: "Silver Walrus") The silver walrus lives in valley number 54'
    )
    assert runs[1][1].endswith("</information>\n\n")
    assert runs[2][1] == SCRIPT["silver walrus"][1]
    # rollout log-probs: the engine's for generated tokens (-0.01 * position within the turn), 0 for observations
    first_turn = runs[0][1]
    assert sample.rollout_log_probs[0] == pytest.approx(-0.01)
    assert all(lp == 0.0 for lp, m in zip(sample.rollout_log_probs, sample.loss_mask, strict=True) if m == 0)
    assert sample.weight_versions == ["7", "7"] and first_turn
    reward = asyncio.run(reward_func(search_r1_args(), sample))
    assert reward["score"] == 1.0 and reward["format_valid"] and reward["retrieval_hit"]


def test_token_in_token_out_keeps_the_engines_stream(servers, tiny_checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    sample = run(make_args(servers, tiny_checkpoint), "Where does the silver walrus live")
    requests = [
        r for r in httpx.get(f"{servers[1].url}/requests").json() if "silver walrus" in tokenizer.decode(r["input_ids"])
    ][-2:]
    # Each turn's input is exactly a prefix of the final token stream: nothing was re-tokenised.
    for request in requests:
        assert sample.tokens[: len(request["input_ids"])] == request["input_ids"]
    assert len(requests[1]["input_ids"]) > len(requests[0]["input_ids"])
    # Re-tokenising the same text would give the trainer a different stream: the turn's "</search>" and the
    # observation's leading "\n\n" merge into other tokens when encoded together.
    retokenised = tokenizer.encode(tokenizer.decode(sample.tokens), add_special_tokens=False)
    assert retokenised != sample.tokens
    assert tokenizer.decode(retokenised) == tokenizer.decode(sample.tokens)


def test_invalid_action_gets_search_r1s_message(servers, tiny_checkpoint):
    sample = run(make_args(servers, tiny_checkpoint), "Where does the blue lynx live")
    sample.metadata["tokenizer"] = str(tiny_checkpoint)
    assert sample.metrics["invalid_actions"] == 1 and sample.metrics["searches"] == 0
    runs = spans(sample)
    assert runs[1] == (0, INVALID_ACTION)
    assert sample.metadata["finish_reason"] == "answer"


def test_max_turns_then_a_final_turn_without_search(servers, tiny_checkpoint):
    sample = run(make_args(servers, tiny_checkpoint, max_turns=2), "Where does the red heron live")
    assert sample.metrics["searches"] == 2 and sample.metrics["turns"] == 3
    assert sample.metadata["finish_reason"] == "final_turn" and sample.status is Status.COMPLETED
    no_final = run(make_args(servers, tiny_checkpoint, max_turns=2, final_turn=False), "Where does the red heron live")
    assert no_final.metrics["turns"] == 2 and no_final.metadata["finish_reason"] == "max_turns"


def test_observation_cap_and_response_budget(servers, tiny_checkpoint):
    capped = run(make_args(servers, tiny_checkpoint, max_obs_tokens=20), "Where does the silver walrus live")
    capped.metadata["tokenizer"] = str(tiny_checkpoint)
    assert capped.metrics["obs_truncations"] == 1 and capped.metrics["searches"] == 1
    assert capped.loss_mask.count(0) == 20
    observation = spans(capped)[1][1]
    assert observation.startswith("\n\n<information>Doc 1(Title:") and observation.endswith("</information>\n\n")
    budget = run(make_args(servers, tiny_checkpoint, max_response_tokens=30), "Where does the black bison live")
    assert budget.status is Status.TRUNCATED and budget.response_length == 30
    assert budget.metadata["finish_reason"] == "length"


def test_eos_without_an_action_gets_the_invalid_action_message_and_another_turn(servers, tiny_checkpoint):
    """Search-R1's loop: a turn with neither search nor answer is an invalid action, also when EOS ended it; the EOS
    is dropped (Search-R1 reads the turn without special tokens), so no trajectory has an EOS in its middle."""
    sample = run(make_args(servers, tiny_checkpoint), "Where does the green otter live")
    sample.metadata["tokenizer"] = str(tiny_checkpoint)
    assert sample.metadata["finish_reason"] == "answer" and sample.status is Status.COMPLETED
    assert sample.metrics["turns"] == 2 and sample.metrics["invalid_actions"] == 1
    assert 151645 not in sample.response_tokens
    assert spans(sample) == [(1, "<think> I will just stop."), (0, INVALID_ACTION), (1, SCRIPT["green otter"][1])]
    reward = asyncio.run(reward_func(search_r1_args(), sample))
    assert reward["score"] == 1.0


def test_a_turn_at_its_token_limit_without_an_action_gets_another_turn(servers, tiny_checkpoint):
    sample = run(make_args(servers, tiny_checkpoint), "Where does the brown hare live", {"max_new_tokens": 40})
    assert sample.metadata["finish_reason"] == "answer" and sample.status is Status.COMPLETED
    assert sample.metrics["invalid_actions"] == 1 and sample.metrics["turns"] == 2
    assert sample.response.endswith("<answer> valley 54 </answer>") and INVALID_ACTION in sample.response


def test_end_on_no_action_keeps_the_old_loop(servers, tiny_checkpoint):
    args = make_args(servers, tiny_checkpoint, end_on_no_action=True)
    eos = run(args, "Where does the green otter live")
    assert eos.metadata["finish_reason"] == "eos" and eos.metrics["turns"] == 1
    assert eos.response_tokens[-1] == 151645 and eos.status is Status.COMPLETED
    length = run(args, "Where does the brown hare live", {"max_new_tokens": 40})
    assert length.metadata["finish_reason"] == "length" and length.status is Status.TRUNCATED
    assert length.response_length == 40 and length.metrics["invalid_actions"] == 0


def test_the_text_ends_at_the_tag_while_the_tokens_keep_the_merged_token(servers, tiny_checkpoint):
    """The token that completes </search> or </answer> carries more characters (Qwen2's ">\n\n", ">."): the policy
    is trained on the token it sampled, and the action parser and the reward read the turn cut at the tag."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    sample = run(make_args(servers, tiny_checkpoint), "Where does the pink crab live")
    generated = [text for text, was_generated in sample.segments if was_generated]
    assert generated == [
        "<think> look </think>\n<search> pink crab </search>",
        "<think> found it </think>\n<answer> valley 54 </answer>",
    ]
    assert tokenizer.decode(sample.response_tokens[-1:]) == ">."
    turn_ends = [i for i in range(1, sample.response_length) if sample.loss_mask[i - 1] == 1 > sample.loss_mask[i]]
    assert tokenizer.decode(sample.response_tokens[turn_ends[0] - 1 : turn_ends[0]]) == ">\n\n"
    assert sample.metrics["searches"] == 1 and sample.metadata["finish_reason"] == "answer"
    v03 = search_r1_args(structure_format_score=0.2, final_format_score=0.1)
    reward = asyncio.run(reward_func(v03, sample))
    assert reward["format_valid"] and reward["score"] == 1.0


def test_special_tokens_the_model_generates_stay_in_the_tokens_but_not_in_the_text(servers, tiny_checkpoint):
    sample = run(make_args(servers, tiny_checkpoint), "Where does the teal newt live")
    assert 151644 in sample.response_tokens and "<|im_start|>" not in sample.response
    v03 = search_r1_args(structure_format_score=0.2, final_format_score=0.1)
    assert asyncio.run(reward_func(v03, sample))["score"] == 1.0


def test_the_first_closing_tag_ends_the_turn(servers, tiny_checkpoint):
    """The engine stops at whichever of </search> and </answer> comes first, so `<search> q </answer> ... </search>`
    is a turn without a complete action (Search-R1, which cuts after generating, would search "q </answer> ...")."""
    sample = run(make_args(servers, tiny_checkpoint), "Where does the olive toad live")
    assert sample.metrics["searches"] == 0 and sample.metrics["invalid_actions"] == 1
    assert sample.response.startswith("<search> olive </answer>" + INVALID_ACTION)
    assert sample.metadata["finish_reason"] == "answer"


def test_an_answer_then_a_search_in_one_turn_ends_at_the_answer(servers, tiny_checkpoint):
    """`<answer> ... </answer> <search> ... </search>` in one turn: the engine stops at the first closing tag, so the
    trajectory answers and the search is never generated (reward 1.0 on v0.3's format rule). Search-R1 generates the
    whole turn and cuts after `</search>`: it trains on both and scores the response 0.8 (malformed, right answer)."""
    v03 = search_r1_args(structure_format_score=0.2, final_format_score=0.1)
    sample = run(make_args(servers, tiny_checkpoint), "Where does the gold eagle live")
    assert sample.response.endswith("<answer> valley 54 </answer>") and "<search>" not in sample.response
    assert sample.metadata["finish_reason"] == "answer" and sample.metrics["searches"] == 0
    assert asyncio.run(reward_func(v03, sample))["score"] == 1.0
    whole_turn = SCRIPT["gold eagle"][0]
    search_r1_cut = whole_turn.split("</search>")[0] + "</search>"  # generation.py's _postprocess_responses
    assert search_r1_cut == whole_turn
    search_r1_score = qa_em_format_score(search_r1_cut, ["valley 54"], RewardConfig.from_args(v03)).score
    assert search_r1_score == pytest.approx(0.8)


def test_search_failure_marks_the_sample_failed(servers, tiny_checkpoint):
    sample = run(
        make_args(servers, tiny_checkpoint, search_url="http://127.0.0.1:9/retrieve", search_retry_window=0.5),
        "Where does the silver walrus live",
    )
    assert sample.status is Status.FAILED and not sample.trainable
    assert sample.metadata["finish_reason"] == "search_error" and "attempts over" in sample.metadata["error"]
    assert "<information>" not in sample.response  # never trained on an empty observation


def test_a_search_that_finds_nothing_says_so_and_the_trajectory_goes_on(servers, tiny_checkpoint):
    sample = run(make_args(servers, tiny_checkpoint), "Where does the white crane live")  # a blank query
    assert sample.status is Status.COMPLETED and sample.metadata["finish_reason"] == "answer"
    assert sample.metrics["searches"] == 1 and sample.metrics["search_empty"] == 1
    assert "<information>No search results are found.</information>" in sample.response
    as_search_r1 = run(make_args(servers, tiny_checkpoint, empty_search_text=""), "Where does the white crane live")
    assert "<information></information>" in as_search_r1.response


def test_malformed_documents_fail_the_sample_not_the_rollout(servers, tiny_checkpoint):
    from tests.conftest import REPO_ROOT

    standin = [str(REPO_ROOT / "tests" / "search_r1" / "serper_standin.py"), "--port", "0", "--api-key", "k"]
    with ServerProcess(standin) as broken_retriever:
        args = make_args(servers, tiny_checkpoint, search_url=f"{broken_retriever.url}/retrieve")
        sample = run(args, "Where does the grey mole live")
    assert sample.status is Status.FAILED and sample.metadata["finish_reason"] == "search_error"
    assert "without 'contents'" in sample.metadata["error"]


@pytest.mark.slow
def test_real_cpu_engine_log_probs_match_the_trainers_forward(tiny_checkpoint, servers):
    """The real CPU engine and retriever: rollout log-probs at mask-1 tokens equal a fresh forward (T = 1)."""
    import torch
    from transformers import AutoModelForCausalLM

    retriever, _ = servers
    argv = ["-m", "slime_search.engines.cpu_engine_server", "--model-path", str(tiny_checkpoint), "--port", "0"]
    with ServerProcess(argv) as engine:
        args = search_r1_args(
            engine_url=engine.url,
            hf_checkpoint=str(tiny_checkpoint),
            search_url=f"{retriever.url}/retrieve",
            apply_chat_template=True,
            max_response_tokens=40,
        )

        async def go():
            samples = [
                Sample(prompt=make_prompt(q))
                for q in ("who is the red otter", "where is valley 3", "what eats gecko food")
            ]
            try:
                return await asyncio.gather(
                    *(generate(args, s, {"temperature": 1.0, "max_new_tokens": 16}) for s in samples)
                )
            finally:
                await close_resources()

        samples = asyncio.run(go())
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    for sample in samples:
        sample.check_alignment()
        with torch.no_grad():
            log_probs = torch.log_softmax(model(torch.tensor([sample.tokens])).logits[0], -1)
        start = sample.prompt_length
        for i, (token, lp, mask) in enumerate(
            zip(sample.response_tokens, sample.rollout_log_probs, sample.loss_mask, strict=True)
        ):
            if mask:
                assert abs(log_probs[start + i - 1, token].item() - lp) < 1e-4
        assert sample.status in (Status.COMPLETED, Status.TRUNCATED)


def test_a_trajectory_waiting_on_search_holds_no_generation_slot(servers, tiny_checkpoint):
    from slime_search.search_r1.generate import session_for

    args = make_args(servers, tiny_checkpoint, generation_concurrency=1)

    async def go(count):
        seen = []
        res = session_for(args).resources
        real_search = res.search.search

        async def observed_search(query):
            seen.append(res.generation_slots.locked())
            return await real_search(query)

        res.search.search = observed_search
        samples = [Sample(prompt=make_prompt("Where does the silver walrus live")) for _ in range(count)]
        try:
            return await asyncio.gather(*(generate(args, s, {"max_new_tokens": 200}) for s in samples)), seen
        finally:
            await close_resources()

    # alone, a trajectory's search finds the only generation slot free: it was released before searching
    done, seen = asyncio.run(go(1))
    assert seen == [False] and done[0].metrics["searches"] == 1
    # three trajectories share the single slot without deadlock, generating while others search
    done, seen = asyncio.run(go(3))
    assert [s.metrics["searches"] for s in done] == [1, 1, 1] and all(
        s.metadata["finish_reason"] == "answer" for s in done
    )


def test_a_rollout_shares_one_session_and_its_end_closes_it(servers, tiny_checkpoint):
    """Settings, tokenizer and pooled clients are built on a rollout's first sample and closed by the plugin's
    end-of-rollout hook; the next rollout (a new event loop) builds its own."""
    from slime_search.search_r1.generate import session_for

    args = make_args(servers, tiny_checkpoint)

    async def rollout():
        samples = [Sample(prompt=make_prompt("Where does the silver walrus live")) for _ in range(3)]
        await asyncio.gather(*(generate(args, s, {"max_new_tokens": 200}) for s in samples))
        session = session_for(args)
        assert session is session_for(args) and session.config.engine_urls == (args.engine_url,)
        await close_resources()
        assert all(client._session.closed for client in session.resources.engines.clients.values())
        return session

    first, second = asyncio.run(rollout()), asyncio.run(rollout())
    assert first is not second and first.config == second.config


def test_web_searches_are_counted_billed_then_cached(servers, tiny_checkpoint, tmp_path, monkeypatch):
    from tests.conftest import REPO_ROOT

    monkeypatch.setenv("SERPER_API_KEY", "k")
    standin = [str(REPO_ROOT / "tests" / "search_r1" / "serper_standin.py"), "--port", "0", "--api-key", "k"]
    with ServerProcess(standin) as serper:
        args = make_args(
            servers,
            tiny_checkpoint,
            search_backend="serper",
            serper_url=f"{serper.url}/search",
            serper_cache=str(tmp_path / "serper.sqlite"),
        )
        first = run(args, "Where does the silver walrus live")
        second = run(args, "Where does the silver walrus live")  # a new rollout: only the SQLite file is shared
    assert (first.metrics["search_billed"], first.metrics["search_cache_hits"]) == (1, 0)
    assert (second.metrics["search_billed"], second.metrics["search_cache_hits"]) == (0, 1)
    assert first.response == second.response and "Eiffel Tower" in first.response


def test_a_groups_identical_web_search_is_sent_once_and_counted_as_a_hit_for_the_others(
    servers, tiny_checkpoint, monkeypatch
):
    from tests.conftest import REPO_ROOT

    monkeypatch.setenv("SERPER_API_KEY", "k")
    standin = [str(REPO_ROOT / "tests" / "search_r1" / "serper_standin.py"), "--port", "0", "--api-key", "k"]
    with ServerProcess([*standin, "--latency-ms", "500"]) as serper:  # slow enough for the group to meet in flight
        args = make_args(servers, tiny_checkpoint, search_backend="serper", serper_url=f"{serper.url}/search")

        async def group():  # GRPO's five samples of one prompt, in one rollout
            samples = [
                Sample(prompt=make_prompt("Where does the silver walrus live"), label={"target": ["valley 54"]})
                for _ in range(5)
            ]
            try:
                return await asyncio.gather(
                    *(generate(args, s, {"temperature": 1.0, "max_new_tokens": 200}) for s in samples)
                )
            finally:
                await close_resources()

        samples = asyncio.run(group())
        calls = httpx.get(f"{serper.url}/health").json()["calls"]
    assert calls == {"silver walrus": 1}
    assert all(s.status is Status.COMPLETED and s.metrics["searches"] == 1 for s in samples)
    assert sum(s.metrics["search_billed"] for s in samples) == 1
    assert sum(s.metrics["search_cache_hits"] for s in samples) == 4
    assert len({s.response for s in samples}) == 1  # one answer, shared
