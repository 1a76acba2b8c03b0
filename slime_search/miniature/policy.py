"""The miniature's policy: a byte-level BPE tokenizer trained on the task's own text, with ChatML special tokens
and the Search-R1 tags as single tokens, and a small randomly initialised Qwen2 model. Built offline. With
--family qwen3: a Qwen3 model (q/k norms, its own head size) and Qwen3's added tokens (<tool_call>, <tool_response>,
<think>, ...), end-of-turn token and chat template, for the native tool-call format; its BPE also learns the tool
calls' and tool responses' text.

    python -m slime_search.miniature.policy --task DIR --out DIR/policy [--hidden-size 128 --num-layers 4]
        [--pretrain-steps 200]   # reading pre-training (slime_search.miniature.pretrain)
        [--family qwen3]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from slime_search.miniature.pretrain import PretrainConfig
from slime_search.models.qwen2_tokenizer import QWEN2_PATTERN, SPECIAL_TOKENS
from slime_search.models.tiny_qwen import TinyQwenConfig

TAGS = ("<think>", "</think>", "<search>", "</search>", "<answer>", "</answer>", "<information>", "</information>")
QWEN3_TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def native_texts(question: str, observation: str) -> list[str]:
    """The native format's text around a question: the tools' declaration, a search call, a tool response."""
    from slime_search.search_r1.tool_format import SEARCH_TOOL

    call = json.dumps({"name": "search", "arguments": {"query": question}})
    return [
        json.dumps(SEARCH_TOOL),
        f"<tool_call>\n{call}\n</tool_call>",
        f"<tool_response>\n{observation}\n</tool_response>",
    ]


def task_texts(task_dir: Path, native: bool = False) -> list[str]:
    """What the policy will read and write: passages as observations show them, prompts, the tag format (and with
    `native`, the tool-call format's text)."""
    from slime_search.rollout.data_source import load_rows
    from slime_search.search_r1.search_clients import format_observation

    docs = [json.loads(line) for line in (task_dir / "corpus.jsonl").read_text().splitlines()]
    observations = [format_observation(docs[i : i + 3]) for i in range(0, len(docs), 3)]
    texts = list(observations)
    for split in ("train", "heldout"):
        questions = [row["prompt"][0]["content"] for row in load_rows(task_dir / f"{split}.parquet")]
        texts += questions
        if native:
            texts += [
                t for q, o in zip(questions, observations * len(questions), strict=False) for t in native_texts(q, o)
            ]
    return texts


def build_tokenizer(texts: list[str], vocab_size: int, family: str = "qwen2"):
    """The BPE of the task's text; Qwen2's ChatML, or with family "qwen3" Qwen3's added tokens (not special: a
    reward or a parser reads them in decoded text), end-of-turn token and chat template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from slime_search.models.qwen2_tokenizer import chatml_tokenizer
    from slime_search.models.qwen3_tokenizer import QWEN3_CHAT_TEMPLATE

    added = TAGS + (QWEN3_TOOL_TOKENS if family == "qwen3" else ())

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    backend.add_tokens([AddedToken(tag, normalized=False) for tag in added])
    tokenizer = chatml_tokenizer(backend, model_max_length=4096)
    if family == "qwen3":
        tokenizer.eos_token = "<|im_end|>"
        tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def build_policy(
    task_dir: str | Path,
    out: str | Path,
    config: TinyQwenConfig,
    vocab_size: int = 4096,
    pretrain: PretrainConfig | None = None,
) -> Path:
    """Tokenizer and Qwen2 model, randomly initialised, then (with `pretrain`) reading pre-training on the task's
    training entities."""
    from slime_search.miniature.pretrain import pretrain_on_task
    from slime_search.models.tiny_qwen import build_tiny_qwen

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    qwen3 = config.family == "qwen3"
    tokenizer = build_tokenizer(task_texts(Path(task_dir), native=qwen3), vocab_size, config.family)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = {
        "vocab_size": len(tokenizer),
        "eos_token_id": eos,
        "end_of_turn_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
    }
    model = build_tiny_qwen(TinyQwenConfig(**{**config.__dict__, **ids}))
    model.config.pad_token_id = model.generation_config.pad_token_id = eos
    model.generation_config.eos_token_id = [eos, tokenizer.convert_tokens_to_ids("<|im_end|>")]  # as Qwen2.5
    if pretrain is not None and pretrain.steps > 0:
        pretrain_on_task(model, tokenizer, task_dir, pretrain)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="build the miniature's tokenizer and tiny Qwen2 policy")
    parser.add_argument("--task", required=True, help="folder written by slime_search.miniature.task")
    parser.add_argument("--out", required=True)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--intermediate-size", type=int, default=512)
    # at 1e6 (Qwen2.5's base) a 32-dim head barely rotates over a 200-token trajectory, so the policy cannot
    # tell "the token 5 back" from "a token 100 back" and never learns to read an answer out of a passage
    parser.add_argument("--rope-theta", type=float, default=10_000.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=("qwen2", "qwen3"), default="qwen2", help="the model and its tokens")
    parser.add_argument("--pretrain-steps", type=int, default=0, help="reading pre-training steps at most (0: none)")
    parser.add_argument(
        "--pretrain-target-loss", type=float, default=PretrainConfig.target_loss, help="stop pre-training below it"
    )
    parser.add_argument("--pretrain-lr", type=float, default=PretrainConfig.lr)
    parser.add_argument("--pretrain-batch-size", type=int, default=PretrainConfig.batch_size)
    parser.add_argument(
        "--tool-format",
        choices=("tags", "qwen3"),
        default="tags",
        help="the layout of the pre-training documents: the run's --tool-format (qwen3 needs --family qwen3)",
    )
    args = parser.parse_args(argv)
    if args.tool_format == "qwen3" and args.family != "qwen3":
        parser.error("--tool-format qwen3 needs --family qwen3: Qwen2's tokenizer has no <tool_call> tokens")
    config = TinyQwenConfig(
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=max(1, args.num_heads // 2),
        intermediate_size=args.intermediate_size,
        rope_theta=args.rope_theta,
        seed=args.seed,
        family=args.family,
    )
    pretrain = PretrainConfig(
        steps=args.pretrain_steps,
        target_loss=args.pretrain_target_loss,
        batch_size=args.pretrain_batch_size,
        lr=args.pretrain_lr,
        seed=args.seed,
        tool_format=args.tool_format,
    )
    print(build_policy(args.task, args.out, config, args.vocab_size, pretrain))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
