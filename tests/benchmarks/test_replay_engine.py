"""The replay engine cuts a scripted turn where SGLang would stop decoding it: the same cut as checking every token
in SGLang's order (length limit, end token, stop string), found with a few decodes instead of one per token."""

import random

import pytest
from transformers import AutoTokenizer

from slime_search.miniature.scripted_turn import turn_response


def cut_token_by_token(tokenizer, text: str, limit: int, stops: list[str]):
    """SGLang's per-token check, written out: the reference the fast cut must equal."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    end_ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    for count in range(1, len(ids) + 1):
        if count >= limit:
            return ids[:count], {"type": "length", "length": limit}
        if ids[count - 1] in end_ids:
            return ids[:count], {"type": "stop", "matched": ids[count - 1]}
        decoded = tokenizer.decode(ids[:count])
        matched = next((s for s in stops if s in decoded), None)
        if matched is not None:
            return ids[:count], {"type": "stop", "matched": matched}
    return ids, {"type": "stop", "matched": None}


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint)


PIECES = ["<think> who is it </think>", "<search> red otter </search>", "<answer> the valley </answer>.", " words",
          "<|im_end|>", "</sea", "rch>", " é café", "\n\n"]  # fmt: skip


def test_the_cut_equals_sglangs_token_by_token_check(tokenizer):
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12)))
        limit = rng.choice([1, 2, 5, 17, 40, 500])
        stops = rng.choice([[], ["</search>", "</answer>"], ["</answer>"], ["otter"]])
        body = {"input_ids": [1], "sampling_params": {"max_new_tokens": limit, "stop": stops}}
        out = turn_response(tokenizer, text, body, "0", lambda i: 0.0)
        ids, finish = cut_token_by_token(tokenizer, text, limit, stops)
        assert (out["output_ids"], out["meta_info"]["finish_reason"]) == (ids, finish), (text, limit, stops)
