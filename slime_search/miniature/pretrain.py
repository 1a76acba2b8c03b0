"""Reading pre-training of the miniature's base model: the skills a pretrained LLM brings to Search-R1.

Search-R1 starts from a pretrained model that can already read: copy a name from the question into a query, and
an answer out of a retrieved passage. A policy trained from scratch has neither skill, and learning them inside a
~200-token Search-R1 prompt is slow, because attention starts spread over the whole prompt. Here the base model
learns them on short documents (~60-100 tokens) in the trajectory format, written about *training* entities only:

    <|im_start|>user\\nQuestion: Where was A B born?\\n<|im_end|>\\n<|im_start|>assistant\\n
    <search> Where was A B born? </search>\\n\\n<information>Doc 1(Title: "A B") A B was born in C.</information>
    \\n\\n<answer> C </answer>

A quarter of each batch puts the same trajectories under Search-R1's whole instruction prompt, so that the instruction
is familiar context by the time SFT starts. Half of the documents read a counterfactual passage, the birthplace replaced
by any word of the task's names (`counterfactual_passages`). With 16 cities, guessing one costs only 2.8 nats an answer.
On some machines' kernels the policy settled there (loss ~0.16, birthplaces never read); with ~100 candidates the only
way down is to copy the word after "born in", which the real cities then reuse. The loss covers the written tokens
except the first one, the decision to search or answer. So pre-training teaches how to search and read, never whether
to. That prior comes from the demonstrations (SFT) and is corrected by RL. RoPE offsets are relative, so the copy heads
learnt here work unchanged inside the full prompt.

With `tool_format="qwen3"` the documents are written in the layout the native loop produces: searches as Qwen3 tool
calls, passages inside the template's tool responses, thinking off. The whole-prompt quarter declares the search tool in
the system turn, as the run's prompts do. So the copy heads are learnt at the distances RL will use.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PretrainConfig:
    steps: int = 800  # at most
    target_loss: float = 0.03  # stop once the mean loss of the last `window` steps is below this (0.05 left one
    # seed of three answering a city it had not read: held-out EM 0.83 after GRPO instead of 0.89)
    window: int = 20
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 10
    max_obs_tokens: int = 96  # as the run's --max-obs-tokens
    full_prompt_fraction: float = 0.25  # documents under Search-R1's whole instruction prompt
    seed: int = 0
    tool_format: str = "tags"  # the layout of the documents: "tags" (Search-R1) or "qwen3" (native tool calls)


@dataclass(frozen=True)
class Document:
    ids: list[int]
    loss_mask: list[int]


def passages_by_title(corpus_path: Path) -> dict[str, dict]:
    docs = [json.loads(line) for line in corpus_path.read_text().splitlines() if line.strip()]
    return {doc["contents"].split("\n", 1)[0].strip('"'): doc for doc in docs}


def reading_document(
    question: str,
    tokenizer,
    passages: dict[str, dict],
    max_obs_tokens: int,
    full_prompt: bool = False,
    tool_format: str = "tags",
) -> Document:
    """One always-searching trajectory of the demonstrator, under the bare question or (`full_prompt`) Search-R1's
    prompt, in the run's `tool_format`; lookup by title stands in for retrieval (top-1 BM25 returns that passage
    for the demonstrator's queries)."""
    from slime_search.miniature.demonstrator import SEARCH_CALLS, next_turn, parse_question

    ids = reading_prompt_ids(question, tokenizer, full_prompt, tool_format)
    mask = [0] * len(ids)
    observations: list[str] = []
    rng = random.Random(0)  # unused: the demonstrator only guesses when it does not search
    for _ in range(3):
        turn = next_turn(question, observations, True, rng, SEARCH_CALLS[tool_format])
        turn_ids = tokenizer.encode(turn, add_special_tokens=False)
        ids += turn_ids
        mask += [0 if not observations else 1] + [1] * (len(turn_ids) - 1)  # not the search-or-answer decision
        if turn.startswith("<answer>"):
            return Document(ids, mask)
        entity, _, _ = parse_question(search_query(turn, tool_format))  # its queries are questions of the task
        obs_ids = reading_observation_ids(tokenizer, passages[entity], max_obs_tokens, tool_format)
        ids += obs_ids
        mask += [0] * len(obs_ids)
        observations.append(tokenizer.decode(obs_ids))
    raise ValueError(f"the demonstrator did not answer {question!r} within three turns")


def reading_prompt_ids(question: str, tokenizer, full_prompt: bool, tool_format: str) -> list[int]:
    """The prompt as the run renders it: the chat template's user turn and generation prompt; in the native
    format with thinking off, and with the search tool declared under the whole prompt."""
    from slime_search.search_r1.prompt import make_prompt
    from slime_search.search_r1.tool_format import native_prompt_ids

    native = tool_format == "qwen3"
    content = make_prompt(question, "native" if native else "base") if full_prompt else f"Question: {question}\n"
    if native and full_prompt:
        return native_prompt_ids(tokenizer, content, page_access=False, thinking=False)
    extra = {"enable_thinking": False} if native else {}
    prompt = [{"role": "user", "content": content}]
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **extra)
    return tokenizer.encode(text, add_special_tokens=False)


def search_query(turn: str, tool_format: str) -> str:
    from slime_search.search_r1.tool_format import parse_tool_call

    if tool_format == "qwen3":
        name, query = parse_tool_call(turn.removeprefix("<tool_call>").removesuffix("</tool_call>"), False)
        assert name == "search", turn  # the demonstrator writes only valid search calls
        return query
    return re.fullmatch(r"<search> (.*) </search>", turn).group(1)


def reading_observation_ids(tokenizer, passage: dict, max_obs_tokens: int, tool_format: str) -> list[int]:
    """The passage as the loop appends it: an <information> block, or (native) the template's tool response after
    a turn that stopped at </tool_call>."""
    from slime_search.search_r1.generate import observation_body, observation_ids
    from slime_search.search_r1.tool_format import bounded_ids, tool_response_text

    if tool_format == "qwen3":
        body = observation_body([passage])
        return bounded_ids(tokenizer, lambda text: tool_response_text(text, False, False), body, max_obs_tokens)[0]
    return observation_ids(tokenizer, [passage], max_obs_tokens)[0]


def counterfactual_passages(passages: dict[str, dict], seed: int) -> dict[str, dict]:
    """The passages with every birthplace replaced by a word drawn from all the words of the task's names and cities
    (one draw per passage, seeded). Founder passages are unchanged: a founder is already one of 1,600 names."""
    born = re.compile(r"^(.* was born in )(\w+)(\.)$", re.DOTALL)
    words = sorted(
        {w for title in passages for w in title.split()}
        | {m.group(2) for d in passages.values() if (m := born.match(d["contents"]))}
    )
    rng = random.Random(seed)
    swapped = {}
    for title, doc in passages.items():
        match = born.match(doc["contents"])
        if match:
            doc = {**doc, "contents": f"{match.group(1)}{rng.choice(words)}{match.group(3)}"}
        swapped[title] = doc
    return swapped


def training_questions(task_dir: Path) -> list[str]:
    from slime_search.rollout.data_source import load_rows

    return [row["question"] for row in load_rows(task_dir / "train.parquet")]


def pretrain(
    model, documents: list[Document], config: PretrainConfig, log=print, long_documents: list[Document] | None = None
) -> list[float]:
    """Next-token loss on the documents' masked tokens, AdamW with linear warm-up, until the loss of the last steps
    is below the target (where the copy skills have formed; when that happens depends on the machine's float rounding)
    or the step budget is spent; returns the loss per step.

        A `full_prompt_fraction` of each batch comes from `long_documents` (the same trajectories under the whole
        instruction prompt), so the instruction's words are familiar context, not noise, when SFT starts.
    """
    import torch

    long_documents = long_documents or []
    n_long = round(config.batch_size * config.full_prompt_fraction) if long_documents else 0
    generator = random.Random(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.98), weight_decay=0.0)
    model.train()
    losses: list[float] = []
    for step in range(config.steps):
        for group in optimizer.param_groups:
            group["lr"] = config.lr * min(1.0, (step + 1) / max(1, config.warmup_steps))
        short = generator.sample(documents, min(config.batch_size - n_long, len(documents)))
        long = generator.sample(long_documents, min(n_long, len(long_documents)))
        loss = batch_loss(model, [short, long])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        recent = losses[-config.window :]
        reached = len(recent) == config.window and sum(recent) / len(recent) < config.target_loss
        if step % 50 == 49 or step == config.steps - 1 or reached:
            log(f"pre-training step {step + 1}/{config.steps}: loss {losses[-1]:.4f}")
        if reached:
            log(
                f"pre-training reached mean loss {sum(recent) / len(recent):.4f} < {config.target_loss} at step {step + 1}"
            )
            break
    model.eval()
    return losses


def padded(batch: list[Document]):
    """Input ids, attention mask and labels (-100 outside the loss mask and on padding) of one right-padded batch."""
    import torch

    width = max(len(doc.ids) for doc in batch)
    inputs = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attention = torch.zeros(len(batch), width, dtype=torch.long)
    for row, doc in enumerate(batch):
        n = len(doc.ids)
        inputs[row, :n] = torch.tensor(doc.ids)
        attention[row, :n] = 1
        labels[row, :n] = torch.tensor([t if m else -100 for t, m in zip(doc.ids, doc.loss_mask, strict=True)])
    return inputs, attention, labels


def batch_loss(model, groups: list[list[Document]]):
    """The mean next-token loss over every loss token of the groups together, each group padded to its own longest
    document. The documents under the whole instruction prompt are about three times the others' length. One padded
    batch spent most of its positions on padding."""
    import torch

    total, count = 0.0, 0
    for group in (g for g in groups if g):
        inputs, attention, labels = padded(group)
        logits = model(input_ids=inputs, attention_mask=attention).logits[:, :-1]
        targets = labels[:, 1:]
        total = total + torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum"
        )
        count += int((targets != -100).sum())
    return total / max(count, 1)


def pretrain_on_task(model, tokenizer, task_dir: str | Path, config: PretrainConfig, log=print) -> list[float]:
    task_dir = Path(task_dir)
    passages = passages_by_title(task_dir / "corpus.jsonl")
    swapped = counterfactual_passages(passages, config.seed)
    questions = training_questions(task_dir)

    def documents_of(passages: dict[str, dict], full_prompt: bool = False) -> list[Document]:
        return [
            reading_document(q, tokenizer, passages, config.max_obs_tokens, full_prompt, config.tool_format)
            for q in questions
        ]

    documents = documents_of(passages) + documents_of(swapped)
    return pretrain(model, documents, config, log, documents_of(passages, full_prompt=True))
