"""Qwen3's native tool calls as the task's action format (--tool-format qwen3).

The tools are declared in the system turn by the model's own chat template; the model calls search as
`<tool_call>\\n{"name": "search", "arguments": {"query": "..."}}\\n</tool_call>` and answers inside
`<answer> ... </answer>` as in Search-R1's format. An observation is the template's rendering of the tool response
that follows the call, tokenised once and appended to the token stream:

    <|im_end|>\\n<|im_start|>user\\n<tool_response>\\nDOCUMENTS\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

(the leading `<|im_end|>` only when the turn stopped at `</tool_call>` rather than on its own end-of-turn token; with
thinking off, the template's empty `<think>\\n\\n</think>\\n\\n` follows, as in its generation prompt). The stream the
trainer sees is exactly what the engine conditioned on: prompt + every generated id + these observation ids. A
chat client that re-sends the message list gets the template's re-rendering instead, which differs (see
examples/search-r1/README.md).
"""

from __future__ import annotations

import json
from typing import Any

TOOL_FORMATS = ("tags", "qwen3")
NATIVE_ACTIONS = ("tool_call", "answer")  # the stop strings: </tool_call> and </answer>

SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search Wikipedia for passages relevant to the query; returns the top passages.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "what to search for"}},
            "required": ["query"],
        },
    },
}
ACCESS_TOOL = {
    "type": "function",
    "function": {
        "name": "access",
        "description": "Read the whole page at a URL given in search results.",
        "parameters": {
            "type": "object",
            "properties": {"url": {"type": "string", "description": "the page's URL"}},
            "required": ["url"],
        },
    },
}
ARGUMENT_OF = {"search": "query", "access": "url"}
NO_ACTION = (
    "My previous turn had no tool call and no answer. To search, call the search tool; to give the final answer, "
    "put it between <answer> and </answer>."
)


def native_tools(page_access: bool) -> list[dict]:
    return [SEARCH_TOOL, ACCESS_TOOL] if page_access else [SEARCH_TOOL]


def parse_tool_call(block: str, page_access: bool) -> tuple[str | None, str]:
    """The inside of a <tool_call> block -> ("search" | "access", its argument), or (None, why it is not a valid
    call). Never raises: a malformed call is an invalid action with a message."""
    try:
        call = json.loads(block)
    except (ValueError, RecursionError) as err:
        return None, f"the tool call is not valid JSON ({str(err)[:80]})"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None, 'the tool call must be a JSON object with a "name" and "arguments"'
    name = call["name"]
    if name not in ARGUMENT_OF or (name == "access" and not page_access):
        tools = ", ".join(t["function"]["name"] for t in native_tools(page_access))
        return None, f"there is no tool named {name[:40]!r} (tools: {tools})"
    arguments = call.get("arguments")
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            arguments = None
    value = arguments.get(ARGUMENT_OF[name]) if isinstance(arguments, dict) else None
    if not isinstance(value, str):
        return None, f'{name} needs "arguments": {{"{ARGUMENT_OF[name]}": "..."}}'
    return name, value.strip()


def tool_response_text(body: str, turn_ended: bool, thinking: bool) -> str:
    """The template's rendering of a tool response after an assistant turn that called a tool. `turn_ended`: the
    turn's last generated id is the end-of-turn token (otherwise it stopped at </tool_call> and the template's
    `<|im_end|>` closes it here)."""
    return (
        ("" if turn_ended else "<|im_end|>")
        + f"\n<|im_start|>user\n<tool_response>\n{body}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        + ("" if thinking else "<think>\n\n</think>\n\n")
    )


def user_message_text(message: str, turn_ended: bool, thinking: bool) -> str:
    """The template's rendering of a user message after an assistant turn (an invalid action's correction)."""
    return (
        ("" if turn_ended else "<|im_end|>")
        + f"\n<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"
        + ("" if thinking else "<think>\n\n</think>\n\n")
    )


def bounded_ids(tokenizer, text_of_body, body: str, cap: int) -> tuple[list[int], bool]:
    """Ids of text_of_body(body), at most `cap` of them, and whether the body was cut: (ids, cut).

    Over the cap the body is cut and the frame around it kept whole (its closing tags and the next generation
    prompt), as the tag format cuts passages."""
    ids = tokenizer.encode(text_of_body(body), add_special_tokens=False)
    if len(ids) <= cap:
        return ids, False
    marker = "\x00"
    head, tail = text_of_body(marker).split(marker)
    head_ids = tokenizer.encode(head, add_special_tokens=False)
    tail_ids = tokenizer.encode(tail, add_special_tokens=False)
    room = max(0, cap - len(head_ids) - len(tail_ids))
    return head_ids + tokenizer.encode(body, add_special_tokens=False)[:room] + tail_ids, True


def native_prompt_ids(tokenizer, prompt: Any, page_access: bool, thinking: bool) -> list[int]:
    """The chat template's rendering of the question with the tools declared, generation prompt included."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(
        messages, tools=native_tools(page_access), tokenize=False, add_generation_prompt=True, enable_thinking=thinking
    )
    return tokenizer.encode(text, add_special_tokens=False)
