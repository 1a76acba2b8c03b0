"""SGLang's /generate answer for a scripted turn: what a policy that means to write `text` gets back from SGLang.

The demonstrator serves its turns this way, and so do the stand-in engines of the tests and benchmarks
(benchmarks/harness/stand_in_engines), so a scripted policy meets the same stop rules as a real one.
"""

from __future__ import annotations


def first_stop(tokenizer, ids: list[int], stops: list[str], upto: int) -> tuple[int, str] | None:
    """The fewest of the first `upto` ids whose decoded text holds a stop string, and that string; a binary search
    (a longer prefix decodes to a longer text), so a long turn costs a few decodes, not one per token."""

    def hit(count: int) -> str | None:
        decoded = tokenizer.decode(ids[:count])
        return next((s for s in stops if s in decoded), None)

    if not stops or upto < 1 or hit(upto) is None:
        return None
    low, high = 1, upto
    while low < high:
        middle = (low + high) // 2
        if hit(middle) is not None:
            high = middle
        else:
            low = middle + 1
    return low, hit(low)


def prompt_ids(tokenizer, body: dict) -> list[int]:
    """The request's prompt as token ids: SGLang takes `input_ids` or a `text` it encodes itself."""
    return body["input_ids"] if "input_ids" in body else tokenizer.encode(body["text"], add_special_tokens=False)


def turn_response(tokenizer, text: str, body: dict, weight_version: str, log_prob) -> dict:
    """SGLang's /generate answer for a scripted turn: `text` encoded and cut where SGLang would stop decoding it. The
    checks run in SGLang's order per token (`Req.check_finished`): the length limit, then an end-of-turn token, then a
    stop string completed by the token. That token is kept whole (`no_stop_trim`), trailing characters included."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    params = body.get("sampling_params", {})
    limit = params.get("max_new_tokens", len(ids))
    end_ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    stops = params.get("stop") or []
    finish = {"type": "stop", "matched": None}  # the script ran out: as if the model ended without a stop token
    length_at = max(1, limit) if limit <= len(ids) else None
    end_at = next((i + 1 for i, token in enumerate(ids) if token in end_ids), None)
    bound = min((at for at in (length_at, end_at) if at is not None), default=None)
    stop = first_stop(tokenizer, ids, stops, len(ids) if bound is None else bound - 1)
    if stop is not None:  # completed before the length limit or an end token
        ids, finish = ids[: stop[0]], {"type": "stop", "matched": stop[1]}
    elif bound is not None and bound == length_at:  # at one count, the length limit comes first
        ids, finish = ids[:bound], {"type": "length", "length": limit}
    elif bound is not None:
        ids, finish = ids[:bound], {"type": "stop", "matched": ids[bound - 1]}
    if limit == 0:
        ids, finish = [], {"type": "length", "length": 0}
    return {
        "text": tokenizer.decode(ids),
        "output_ids": ids,
        "meta_info": {
            "finish_reason": finish,
            "output_token_logprobs": [[log_prob(i), t, None] for i, t in enumerate(ids)],
            "prompt_tokens": len(prompt_ids(tokenizer, body)),
            "completion_tokens": len(ids),
            "weight_version": weight_version,
        },
    }
