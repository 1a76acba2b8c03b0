"""Qwen3's tokenizer built offline: the published added tokens at their ids, what decoding keeps, and the chat
template's renderings (thinking on and off, tools, tool calls and responses, history re-rendered)."""

import json

import pytest

from slime_search.models.qwen3_tokenizer import QWEN3_ADDED_TOKENS, build_qwen3_tokenizer

# From the published Qwen3 tokenizer_config.json (added_tokens_decoder): id -> (content, special)
PUBLISHED = {
    151643: ("<|endoftext|>", True), 151644: ("<|im_start|>", True), 151645: ("<|im_end|>", True),
    151657: ("<tool_call>", False), 151658: ("</tool_call>", False), 151665: ("<tool_response>", False),
    151666: ("</tool_response>", False), 151667: ("<think>", False), 151668: ("</think>", False),
    151656: ("<|video_pad|>", True), 151664: ("<|file_sep|>", False),
}  # fmt: skip
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search Wikipedia",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_qwen3_tokenizer()


def test_added_tokens_have_the_published_ids_and_flags(tokenizer):
    assert len(tokenizer) == 151669 and len(QWEN3_ADDED_TOKENS) == 23
    decoder = tokenizer.added_tokens_decoder
    for token_id, (content, special) in PUBLISHED.items():
        assert decoder[token_id].content == content and decoder[token_id].special is special, token_id
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.encode("<think>\nno\n</think>", add_special_tokens=False) == [151667, 198, 2152, 198, 151668]
    ids = tokenizer.encode("<|im_start|>a<tool_call>b</tool_call><|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a<tool_call>b</tool_call>"  # tags kept, ChatML not


def test_generation_prompt_with_thinking_on_and_off(tokenizer):
    messages = [{"role": "user", "content": "Who wrote Hamlet?"}]
    on = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    off = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert on == "<|im_start|>user\nWho wrote Hamlet?<|im_end|>\n<|im_start|>assistant\n"
    assert off == on + "<think>\n\n</think>\n\n"


def test_tools_are_declared_in_the_system_turn_and_calls_and_responses_rendered(tokenizer):
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Who wrote Hamlet?"},
        {"role": "assistant", "content": "<think>\nlook it up\n</think>\n\n", "tool_calls": [
            {"type": "function", "function": {"name": "search", "arguments": {"query": "Hamlet author"}}}]},
        {"role": "tool", "content": "Doc 1(Title: Hamlet) by Shakespeare"},
        {"role": "assistant", "content": "<think>\nfound\n</think>\n\nShakespeare"},
    ]  # fmt: skip
    text = tokenizer.apply_chat_template(messages, tools=[SEARCH_TOOL], tokenize=False)
    declared = "<tools>\n" + json.dumps(SEARCH_TOOL) + "\n</tools>"
    assert text.startswith("<|im_start|>system\nAnswer briefly.\n\n# Tools\n\nYou may call one or more functions")
    assert declared in text
    assert (
        '<|im_start|>assistant\n<think>\nlook it up\n</think>\n\n<tool_call>\n{"name": "search", "arguments": '
        '{"query": "Hamlet author"}}\n</tool_call><|im_end|>\n'
    ) in text  # after the last user query: the reasoning is kept
    assert (
        "<|im_start|>user\n<tool_response>\nDoc 1(Title: Hamlet) by Shakespeare\n</tool_response><|im_end|>\n" in text
    )
    assert text.endswith("<|im_start|>assistant\n<think>\nfound\n</think>\n\nShakespeare<|im_end|>\n")


def test_earlier_turns_lose_their_thinking_when_a_new_query_follows(tokenizer):
    """Not append-only: the reasoning of turns before the last user query is dropped from the rendered history."""
    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nA1"},
        {"role": "user", "content": "second"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "old reasoning" not in text and "<|im_start|>assistant\nA1<|im_end|>\n" in text


def test_the_tiny_qwen3_checkpoint_names_the_published_qwen3s_special_ids(tiny_qwen3_checkpoint):
    """What the published Qwen3 (0.6B-8B) files say, and SGLang reads its stop tokens from: generation_config.json
    ends a turn at <|im_end|> (151645) or <|endoftext|> (151643) and pads with <|endoftext|>; config.json names
    <|im_end|> as eos and <|endoftext|> as bos; the tokenizer has no bos, eos <|im_end|>, pad <|endoftext|>."""
    generation = json.loads((tiny_qwen3_checkpoint / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"], generation["bos_token_id"]) == (
        [151645, 151643],
        151643,
        151643,
    )
    config = json.loads((tiny_qwen3_checkpoint / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"]) == (151645, 151643)
    tokenizer = json.loads((tiny_qwen3_checkpoint / "tokenizer_config.json").read_text())
    assert (tokenizer.get("bos_token"), tokenizer["eos_token"], tokenizer["pad_token"]) == (
        None,
        "<|im_end|>",
        "<|endoftext|>",
    )
