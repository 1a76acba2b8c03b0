"""The miniature: synthetic task, scripted demonstrator (through the real generate loop and retriever), the
policy's tokenizer, and the run report."""

import asyncio
import json
import os
import random
import re
import subprocess
from pathlib import Path

import pytest

from slime_search.miniature import demonstrator as demo
from slime_search.miniature.task import CITIES, make_task, write_task
from slime_search.search_r1.prompt import make_prompt


def test_task_is_deterministic_and_held_out_entities_are_unseen_in_training():
    first, again = make_task(seed=3, people=40, companies=12), make_task(seed=3, people=40, companies=12)
    assert first == again and make_task(seed=4, people=40, companies=12) != first
    assert len(first.corpus) == 52 and len(first.train) == 20 + 12 and len(first.heldout) == 20 + 12
    train_entities = {q.entity for q in first.train} | {q.bridge for q in first.train if q.bridge}
    heldout_entities = {q.entity for q in first.heldout}
    assert not train_entities & heldout_entities
    by_title = {doc["contents"].split("\n")[0].strip('"'): doc["contents"] for doc in first.corpus}
    for question in first.train + first.heldout:
        # the answer is stated in the passage of the entity asked about (two-hop: of the founder)
        assert question.answer in by_title[question.bridge or question.entity]
        if question.hops == 2:
            assert f"founded by {question.bridge}." in by_title[question.entity]
    assert {q.hops for q in first.heldout} == {1, 2}


def test_names_are_new_combinations_of_words_seen_in_training():
    """Every word of a held-out name also appears in training questions; the name as a whole never does."""
    task = make_task(seed=0, people=800, companies=200)
    words = lambda questions: {w for q in questions for w in q.question.rstrip("?").split()}  # noqa: E731
    held_names = {q.entity for q in task.heldout if q.kind == "city" and q.hops == 1}
    assert {w for name in held_names for w in name.split()} <= words(task.train)
    assert not held_names & {q.entity for q in task.train}
    with pytest.raises(ValueError, match="at most 1600 people"):
        make_task(seed=0, people=1601, companies=10)


def test_task_files_use_search_r1_schema(tmp_path):
    from slime_search.rollout.data_source import load_rows

    write_task(make_task(seed=0, people=20, companies=6), tmp_path, heldout_limit=5)
    rows = load_rows(tmp_path / "train.parquet")
    assert rows[0]["prompt"][0]["content"].startswith("Answer the given question.")
    assert rows[0]["reward_model"]["ground_truth"]["target"] and rows[0]["data_source"].startswith("miniature_")
    assert len(load_rows(tmp_path / "heldout.parquet")) == 5
    docs = [json.loads(line) for line in (tmp_path / "corpus.jsonl").read_text().splitlines()]
    assert set(docs[0]) == {"id", "contents"} and docs[0]["contents"].startswith('"')


def observation(contents: str) -> str:
    return f"Doc 1(Title: {contents.split(chr(10))[0]}) {contents.split(chr(10))[1]}\n"


def test_demonstrator_searches_reads_and_answers_two_hop_questions():
    task = make_task(seed=1, people=30, companies=10)
    question = next(q for q in task.train if q.hops == 2)
    docs = {d["contents"].split("\n")[0].strip('"'): d["contents"] for d in task.corpus}
    rng = random.Random(0)
    assert demo.next_turn(question.question, [], True, rng) == f"<search> {question.question} </search>"
    second = demo.next_turn(question.question, [observation(docs[question.entity])], True, rng)
    assert second == f"<search> Where was {question.bridge} born? </search>"
    obs = [observation(docs[question.entity]), observation(docs[question.bridge])]
    assert demo.next_turn(question.question, obs, True, rng) == f"<answer> {question.answer} </answer>"
    guess = demo.next_turn(question.question, [], False, rng)
    assert re.fullmatch(r"<answer> (\w+) </answer>", guess).group(1) in CITIES


def test_the_demonstrator_speaks_qwen3_tool_calls_and_reads_tool_responses():
    """POLICY=qwen3 TOOL_FORMAT=qwen3: the same decisions, searches as Qwen3's tool calls, observations read from the
    tool responses of the whole trajectory (each turn opens an assistant header of its own)."""
    task = make_task(seed=1, people=30, companies=10)
    question = next(q for q in task.train if q.hops == 2)
    docs = {d["contents"].split("\n")[0].strip('"'): d["contents"] for d in task.corpus}
    rng = random.Random(0)
    first = demo.next_turn(question.question, [], True, rng, demo.tool_call_search)
    call = json.loads(first.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call == {"name": "search", "arguments": {"query": question.question}}
    prompt = (
        "<|im_start|>system\n# Tools ... <tool_call></tool_call><|im_end|>\n<|im_start|>user\nQuestion: x?<|im_end|>\n"
        f"<|im_start|>assistant\n{first}<|im_end|>\n<|im_start|>user\n<tool_response>\n"
        f"{observation(docs[question.entity])}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    observations = demo.observations_in(prompt)
    assert observations == [observation(docs[question.entity])]
    second = demo.next_turn(question.question, observations, True, rng, demo.tool_call_search)
    assert json.loads(second.split("\n")[1])["arguments"]["query"] == f"Where was {question.bridge} born?"
    tagged = f"<|im_start|>assistant\n<search> q </search>\n\n<information>{observation(docs[question.entity])}</information>"
    assert demo.observations_in(tagged) == [observation(docs[question.entity])]  # the tag format as before


def test_a_qwen3_miniature_tokenizer_has_qwen3s_tool_tokens_and_template(tmp_path):
    from slime_search.miniature.policy import build_tokenizer, task_texts
    from slime_search.search_r1.tool_format import SEARCH_TOOL

    write_task(make_task(seed=0, people=20, companies=6), tmp_path, template="native")
    texts = task_texts(tmp_path, native=True)
    assert any(t.startswith('<tool_call>\n{"name": "search"') for t in texts)
    tokenizer = build_tokenizer(texts, 1024, "qwen3")
    for token in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "<answer>"):
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    assert tokenizer.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "Question: where?"}]
    text = tokenizer.apply_chat_template(messages, tools=[SEARCH_TOOL], tokenize=False, add_generation_prompt=True, enable_thinking=False)  # fmt: skip
    assert "<tools>\n" + json.dumps(SEARCH_TOOL) in text and text.endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    from slime_search.rollout.data_source import load_rows

    prompt = load_rows(tmp_path / "train.parquet")[0]["prompt"][0]["content"]
    assert "call the search tool" in prompt and "<search>" not in prompt  # the native prompt template


def test_demonstrator_coin_is_seeded_per_question_visit_and_has_the_asked_rate():
    draws = [demo.searches_this_time(f"q{i}", 1, seed=0, search_prob=0.3) for i in range(4000)]
    assert abs(sum(draws) / len(draws) - 0.3) < 0.03
    assert draws == [demo.searches_this_time(f"q{i}", 1, seed=0, search_prob=0.3) for i in range(4000)]
    assert draws != [demo.searches_this_time(f"q{i}", 2, seed=0, search_prob=0.3) for i in range(4000)]
    with pytest.raises(ValueError, match="not a question"):
        demo.parse_question("What is the capital of France?")


@pytest.fixture(scope="module")
def miniature(tmp_path_factory):
    from slime_search.miniature.policy import build_policy
    from slime_search.models.tiny_qwen import TinyQwenConfig

    root = tmp_path_factory.mktemp("miniature")
    write_task(make_task(seed=2, people=60, companies=20), root / "task")
    build_policy(root / "task", root / "policy", TinyQwenConfig(hidden_size=32, num_layers=1), vocab_size=4096)
    return root


def test_policy_tokenizer_keeps_tags_whole_and_round_trips(miniature):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(miniature / "policy")
    text = "<search> Where was Ab Cd born? </search>\n\n<information>Doc 1(Title: x) y</information>\n\n<answer> Qarnis </answer>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    for tag in ("<search>", "</search>", "<answer>", "</answer>", "<information>", "</information>"):
        assert len(tokenizer.encode(tag, add_special_tokens=False)) == 1
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|endoftext|>"
    docs = (miniature / "task" / "corpus.jsonl").read_text()
    names = [json.loads(line)["contents"].split("\n")[1].split(" was ")[0] for line in docs.splitlines()]
    for word in {w for name in names for w in name.split()} | {c for c in CITIES if f" {c}." in docs}:
        assert len(tokenizer.encode(" " + word, add_special_tokens=False)) == 1, word


@pytest.mark.slow
@pytest.mark.parametrize("search_prob", [1.0, 0.0])
def test_demonstrations_through_the_generate_loop_and_a_real_retriever(miniature, search_prob):
    """With search always on, every demonstration reaches the gold answer via real BM25 search; with it off,
    none searches."""
    from local_dense_retriever import build_index
    from local_dense_retriever.launch import RetrievalServerProcess
    from slime_search.rollout.data_source import DataConfig, DataSource
    from slime_search.rollout.rollout import RolloutConfig, generate_rollout
    from slime_search.search_r1.config import search_r1_args
    from slime_search.search_r1.generate import close_resources, generate
    from slime_search.search_r1.reward import reward_func
    from slime_search.utils.server_process import ServerProcess

    corpus = miniature / "task" / "corpus.jsonl"
    if not (miniature / "bm25").is_dir():
        build_index.main(["--retriever-name", "bm25", "--corpus-path", str(corpus), "--save-dir", str(miniature)])
    demo_argv = ["-m", "slime_search.miniature.demonstrator", "--tokenizer", str(miniature / "policy"),
                 "--search-prob", str(search_prob), "--port", "0"]  # fmt: skip
    retriever_argv = ["--retriever-name", "bm25", "--index-path", str(miniature / "bm25"), "--corpus-path",
                      str(corpus), "--topk", "1"]  # fmt: skip
    with RetrievalServerProcess(*retriever_argv) as retriever, ServerProcess(demo_argv) as engine:
        args = search_r1_args(
            engine_url=engine.url, hf_checkpoint=str(miniature / "policy"), search_url=f"{retriever.url}/retrieve",
            apply_chat_template=True, search_topk=1, max_turns=2,
        )  # fmt: skip
        source = DataSource(DataConfig(str(miniature / "task" / "heldout.parquet")))

        async def run():
            try:
                return await generate_rollout(
                    args, source, RolloutConfig(batch_size=len(source), n_samples_per_prompt=1), generate,
                    reward_func, {"temperature": 1.0, "max_new_tokens": 48},
                )  # fmt: skip
            finally:
                await close_resources()

        groups, _ = asyncio.run(run())
    samples = [s for g in groups for s in g]
    searches = [s.metrics["searches"] for s in samples]
    if search_prob == 1.0:
        wrong = [(s.label, s.response) for s in samples if s.reward["score"] != 1.0]
        assert not wrong, wrong[:1]
        # reading pre-training writes the very tokens the generate loop produces (for the same turns)
        from transformers import AutoTokenizer

        from slime_search.miniature.pretrain import passages_by_title, reading_document

        tokenizer = AutoTokenizer.from_pretrained(miniature / "policy")
        passages = passages_by_title(corpus)
        for sample in samples:
            question = demo.QUESTION.search(tokenizer.decode(sample.tokens[: sample.prompt_length])).group(1)
            document = reading_document(question, tokenizer, passages, max_obs_tokens=512)
            response = sample.tokens[len(sample.tokens) - sample.response_length :]
            assert document.ids[len(document.ids) - len(response) :] == response
        two_hop = [s for s in samples if s.metadata["data_source"] == "miniature_2hop"]
        assert two_hop and all(s.metrics["searches"] == 2 for s in two_hop)
    else:
        assert searches == [0] * len(samples)


def test_report_renders_curves_metrics_and_highlighted_rollouts(tmp_path):
    from slime_search.report import main as report_main

    with open(tmp_path / "metrics.jsonl", "w") as handle:
        for step in range(3):
            handle.write(json.dumps({"step": step, "eval/em": 0.1 * step, "eval/search_rate": 0.2 * step}) + "\n")
            handle.write(json.dumps({"step": step, "rollout/reward_mean": 0.3, "train/loss": 1.0 - step}) + "\n")
    example = {
        "step": 2, "kind": "eval", "prompt": "Answer... Question: Where was Ab Cd born?\n", "reward": 1.0,
        "searches": 1, "label": {"ground_truth": {"target": ["Qarnis"]}},
        "segments": [["<search> Ab Cd </search>", True], ["\n\n<information>Doc 1 <b></information>\n\n", False],
                     ["<answer> Qarnis </answer>", True]],
    }  # fmt: skip
    (tmp_path / "rollouts.jsonl").write_text(json.dumps(example) + "\n")
    assert report_main([str(tmp_path)]) == 0
    out = tmp_path / "report"
    for name in ("reward.png", "em.png", "search_rate.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "loss.png").exists()  # the GRPO loss is mean-zero: the health panels replace its curve
    page = (out / "index.html").read_text()
    assert '<span class="search">&lt;search&gt; Ab Cd &lt;/search&gt;</span>' in page
    assert '<span class="obs">' in page and "&lt;b&gt;" in page  # passages are escaped, not injected
    assert '<span class="answer">' in page and "Where was Ab Cd born?" in page
    assert report_main([str(tmp_path / "missing")]) == 2


def test_demonstrator_answers_a_prompt_without_a_question_with_400(miniature):
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(miniature / "policy")
    client = TestClient(demo.build_app(tokenizer, seed=0, search_prob=1.0))
    ids = tokenizer.encode("hello there", add_special_tokens=False)
    response = client.post("/generate", json={"input_ids": ids, "sampling_params": {}})
    assert response.status_code == 400 and "Question" in response.json()["error"]
    question = tokenizer.encode("Question: Where was Ab Cd born?\n", add_special_tokens=False)
    body = {"input_ids": question, "sampling_params": {"max_new_tokens": 3, "stop": ["</search>"]}}
    answer = client.post("/generate", json=body).json()
    assert len(answer["output_ids"]) == 3 and answer["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_reading_documents_teach_searching_and_reading_but_not_the_decision(miniature):
    from transformers import AutoTokenizer

    from slime_search.miniature.pretrain import passages_by_title, reading_document, training_questions
    from slime_search.rollout.data_source import load_rows

    tokenizer = AutoTokenizer.from_pretrained(miniature / "policy")
    passages = passages_by_title(miniature / "task" / "corpus.jsonl")
    questions = training_questions(miniature / "task")
    held_out = {row["question"] for row in load_rows(miniature / "task" / "heldout.parquet")}
    assert questions and not set(questions) & held_out  # only training entities are read

    task = make_task(seed=2, people=60, companies=20)
    two_hop = next(q for q in task.train if q.hops == 2)
    document = reading_document(two_hop.question, tokenizer, passages, max_obs_tokens=96)
    trained = tokenizer.decode([t for t, m in zip(document.ids, document.loss_mask, strict=True) if m])
    # every written token but the first (<search> or <answer>: whether to search) is trained; passages are not
    assert trained == (
        f" {two_hop.question} </search><search> Where was {two_hop.bridge} born? </search>"
        f"<answer> {two_hop.answer} </answer>"
    )
    text = tokenizer.decode(document.ids)
    assert text.count("<information>") == 2 and f"founded by {two_hop.bridge}." in text
    assert text.startswith(f"<|im_start|>user\nQuestion: {two_hop.question}\n<|im_end|>")

    long = reading_document(two_hop.question, tokenizer, passages, max_obs_tokens=96, full_prompt=True)
    response = len(document.ids) - document.loss_mask.index(1) + 1
    assert long.ids[-response:] == document.ids[-response:] and len(long.ids) > len(document.ids) + 100


def test_native_reading_documents_have_the_layout_of_the_native_loop(tmp_path):
    """POLICY=qwen3 TOOL_FORMAT=qwen3: the reading documents are what the native loop writes (tool calls, the
    template's tool responses, thinking off), so the copy skills are learnt at the distances RL uses; the same tokens
    are trained as in the tag format."""
    from slime_search.miniature.policy import build_tokenizer, task_texts
    from slime_search.miniature.pretrain import passages_by_title, reading_document
    from slime_search.search_r1.generate import observation_body
    from slime_search.search_r1.tool_format import native_prompt_ids, tool_response_text

    task = make_task(seed=2, people=60, companies=20)
    write_task(task, tmp_path, template="native")
    tokenizer = build_tokenizer(task_texts(tmp_path, native=True), 2048, "qwen3")
    passages = passages_by_title(tmp_path / "corpus.jsonl")
    two_hop = next(q for q in task.train if q.hops == 2)
    document = reading_document(two_hop.question, tokenizer, passages, 96, tool_format="qwen3")

    def call(query):
        return f'<tool_call>\n{{"name": "search", "arguments": {{"query": "{query}"}}}}\n</tool_call>'

    def response(title):
        return tool_response_text(observation_body([passages[title]]), turn_ended=False, thinking=False)

    bridge_query = f"Where was {two_hop.bridge} born?"
    expected = (
        f"<|im_start|>user\nQuestion: {two_hop.question}\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        f"{call(two_hop.question)}{response(two_hop.entity)}{call(bridge_query)}{response(two_hop.bridge)}"
        f"<answer> {two_hop.answer} </answer>"
    )
    assert tokenizer.decode(document.ids) == expected
    trained = tokenizer.decode([t for t, m in zip(document.ids, document.loss_mask, strict=True) if m])
    assert (
        trained
        == f"{call(two_hop.question).removeprefix('<tool_call>')}{call(bridge_query)}<answer> {two_hop.answer} </answer>"
    )

    long = reading_document(two_hop.question, tokenizer, passages, 96, full_prompt=True, tool_format="qwen3")
    prompt = native_prompt_ids(tokenizer, make_prompt(two_hop.question, "native"), page_access=False, thinking=False)
    assert long.ids[: len(prompt)] == prompt  # the tool declared in the system turn, as the run's prompts
    response_length = len(document.ids) - document.loss_mask.index(1) + 1
    assert long.ids[-response_length:] == document.ids[-response_length:]


def test_pretraining_lowers_the_reading_loss(miniature):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slime_search.miniature.pretrain import PretrainConfig, pretrain_on_task

    tokenizer = AutoTokenizer.from_pretrained(miniature / "policy")
    model = AutoModelForCausalLM.from_pretrained(miniature / "policy")
    config = PretrainConfig(steps=30, batch_size=8, lr=6e-3, seed=0)
    losses = pretrain_on_task(model, tokenizer, miniature / "task", config, log=lambda line: None)
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses
    assert not model.training


def test_pretraining_loss_by_length_groups_is_the_one_padded_batchs(miniature):
    """Each group padded to its own longest document: the loss and every gradient are those of the whole batch
    padded to its longest, the mean over all loss tokens (not a mean of the groups' means)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slime_search.miniature.pretrain import batch_loss, padded, passages_by_title, reading_document

    tokenizer = AutoTokenizer.from_pretrained(miniature / "policy")
    model = AutoModelForCausalLM.from_pretrained(miniature / "policy", dtype=torch.float64)
    passages = passages_by_title(miniature / "task" / "corpus.jsonl")
    questions = [f"Where was {title} born?" for title in list(passages)[:40] if " " in title][:5]
    short = [reading_document(q, tokenizer, passages, 96) for q in questions[:4]]
    long = [reading_document(questions[4], tokenizer, passages, 96, full_prompt=True)]
    assert len(long[0].ids) > 2 * max(len(d.ids) for d in short)

    def loss_and_grads(compute):
        model.zero_grad()
        loss = compute()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    grouped, grouped_grads = loss_and_grads(lambda: batch_loss(model, [short, long]))
    whole, whole_grads = loss_and_grads(lambda: batch_loss(model, [short + long]))
    assert torch.allclose(grouped, whole, rtol=1e-10), (grouped, whole)
    inputs, attention, labels = padded(short + long)  # one group's loss is Hugging Face's (which upcasts to fp32)
    hf_loss = model(input_ids=inputs, attention_mask=attention, labels=labels).loss
    assert abs(float(hf_loss) - float(whole)) < 1e-6 * float(whole)
    assert all(torch.allclose(a, b, rtol=1e-8, atol=1e-12) for a, b in zip(grouped_grads, whole_grads, strict=True))
    separately = (batch_loss(model, [short]) + batch_loss(model, [long])) / 2
    assert not torch.isclose(separately.detach(), whole)  # the groups' tokens differ in number: weighting matters


def test_pretraining_stops_once_its_loss_is_below_the_target(miniature):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slime_search.miniature.pretrain import PretrainConfig, pretrain_on_task

    tokenizer = AutoTokenizer.from_pretrained(miniature / "policy")
    model = AutoModelForCausalLM.from_pretrained(miniature / "policy")
    logged = []
    # a target every 5-step mean of a fresh model beats (its loss starts near ln(vocab) = 8.3)
    config = PretrainConfig(steps=30, batch_size=4, target_loss=50.0, window=5, seed=0)
    losses = pretrain_on_task(model, tokenizer, miniature / "task", config, log=logged.append)
    assert len(losses) == 5 and "reached mean loss" in logged[-1]
    unreachable = PretrainConfig(steps=7, batch_size=4, target_loss=0.0, window=5, seed=0)
    assert len(pretrain_on_task(model, tokenizer, miniature / "task", unreachable, log=lambda line: None)) == 7


def test_counterfactual_passages_change_every_birthplace_and_nothing_else(miniature):
    from slime_search.miniature.pretrain import counterfactual_passages, passages_by_title

    passages = passages_by_title(miniature / "task" / "corpus.jsonl")
    swapped = counterfactual_passages(passages, seed=0)
    assert swapped == counterfactual_passages(passages, seed=0) and swapped != counterfactual_passages(passages, 1)
    born = [t for t, d in passages.items() if " was born in " in d["contents"]]
    founded = [t for t, d in passages.items() if " was founded by " in d["contents"]]
    assert born and founded and len(born) + len(founded) == len(passages)
    assert all(swapped[t] == passages[t] for t in founded)
    words = {w for title in passages for w in title.split()} | set(CITIES)
    places = [swapped[t]["contents"].rsplit(" born in ", 1)[1].rstrip(".") for t in born]
    assert set(places) <= words and len(set(places)) > 16  # far more candidates than the 16 real cities
    assert all(
        swapped[t]["contents"].rsplit(" born in ", 1)[0] == passages[t]["contents"].rsplit(" born in ", 1)[0]
        for t in born
    )


def test_native_pretraining_needs_the_qwen3_tokens(tmp_path, capsys):
    from slime_search.miniature.policy import main

    with pytest.raises(SystemExit) as stop:
        main(["--task", str(tmp_path), "--out", str(tmp_path / "p"), "--tool-format", "qwen3"])
    assert stop.value.code == 2 and "--tool-format qwen3 needs --family qwen3" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()  # refused before anything is built


def test_the_run_script_stops_only_after_sft_and_refuses_another_phase_before_any_work(tmp_path):
    """STOP_AFTER=sft prepares an SFT start for several RL runs (the benchmarks' smoke runs share one: the fixture in
    tests/benchmarks/conftest.py); any other phase is refused before anything is made."""
    script = Path(__file__).resolve().parents[2] / "examples" / "search-r1" / "run_miniature_cpu.sh"
    env = {**os.environ, "RUN_DIR": str(tmp_path / "run"), "STOP_AFTER": "rl"}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "the one phase to stop after is sft" in done.stderr
    assert not (tmp_path / "run").exists()
