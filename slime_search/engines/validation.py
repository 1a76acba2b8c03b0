"""Checks of the CPU engine server's request bodies: every malformed body or parameter gets a 400 with a message, never
a 500. A 500 closes the keep-alive connection. For a broken worker it can take the batch with it. The checks run before
anything reaches the engine's worker thread."""

from __future__ import annotations

import json
import math
from typing import Any

# The torch dtypes a weight bucket may announce (SGLang sends them as "bfloat16", "torch.bfloat16", ...).
BUCKET_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool")


class BadRequest(ValueError):
    """400 with SGLang's error body {"error": {"message": ...}}."""


class SchemaViolation(BadRequest):
    """400 with SGLang 0.5.23's schema-check body {"error": "..."} (a string)."""


def _refuse_constant(name: str):
    raise BadRequest(f"body is not valid JSON: {name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # "1e999" parses to inf
        raise BadRequest(f"body is not valid JSON: the number {text[:40]} is out of range")
    return value


def parse_json_object(raw: bytes, endpoint: str) -> dict[str, Any]:
    """The body as a JSON object (an empty body is {}). NaN, Infinity and numbers that overflow a float are refused,
    as JSON (RFC 8259) and SGLang's parser refuse them; so are nesting too deep to parse and over-long integers."""
    try:
        body = json.loads(raw or b"{}", parse_constant=_refuse_constant, parse_float=_finite_float)
    except BadRequest:
        raise
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError, int digit limit, depth
        raise BadRequest(f"body is not valid JSON: {type(err).__name__}: {str(err)[:200]}") from err
    if not isinstance(body, dict):
        raise BadRequest(f"{endpoint} takes a JSON object, not a {type(body).__name__}")
    return body


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(body: dict, key: str, low: int | None = None, high: int | None = None) -> int:
    """A required integer field within [low, high]."""
    value = body.get(key)
    if not is_int(value):
        raise BadRequest(f"'{key}' must be an integer, got {_shown(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise BadRequest(f"'{key}' must be in [{low}, {high}], got {value}")
    return value


def string(body: dict, key: str, default: str | None = None) -> str:
    """A string field; `default` when absent or null (None: required)."""
    value = body.get(key)
    if value is None and default is not None:
        return default
    if not isinstance(value, str) or not value:
        raise BadRequest(f"'{key}' must be a non-empty string, got {_shown(value)}")
    return value


def optional_version(body: dict) -> str | None:
    """SGLang's `weight_version`: a string (numbers are accepted and turned into one), or absent."""
    version = body.get("weight_version")
    if version is None:
        return None
    if isinstance(version, bool) or not isinstance(version, (str, int, float)):
        raise BadRequest(f"'weight_version' must be a string, got {_shown(version)}")
    return str(version)


def weight_group_join(body: dict, default_name: str) -> dict[str, Any]:
    """/init_weights_update_group's fields. The engine's ranks follow the trainer's rank 0."""
    world_size = integer(body, "world_size", 2, 1 << 16)
    return {
        "name": string(body, "group_name", default_name),
        "backend": string(body, "backend", "gloo"),
        "address": string(body, "master_address"),
        "port": integer(body, "master_port", 1, 65535),
        "rank": integer(body, "rank_offset", 1, world_size - 1),
        "world_size": world_size,
    }


def weight_bucket(body: dict) -> tuple[list[str], list[str], list[list[int]]]:
    """/update_weights_from_distributed's announcement: names, dtypes and shapes, one of each per tensor."""
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise BadRequest("'names' must be a list of non-empty strings")
    if not isinstance(dtypes, list) or not all(
        isinstance(d, str) and d.removeprefix("torch.") in BUCKET_DTYPES for d in dtypes
    ):
        raise BadRequest(f"'dtypes' must be a list of dtype names ({', '.join(BUCKET_DTYPES)})")
    if not isinstance(shapes, list) or not all(
        isinstance(s, list) and all(is_int(n) and 0 <= n < 1 << 31 for n in s) for s in shapes
    ):
        raise BadRequest("'shapes' must be a list of lists of non-negative integers")
    if not len(names) == len(dtypes) == len(shapes):
        raise BadRequest(f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes")
    return names, dtypes, shapes


def _shown(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text[:60]


def logprob_start(value: Any, input_length: int) -> int | None:
    """SGLang's logprob_start_len: -1 (its default) asks for no input log-probs, 0..the prompt's length for those
    from that token on; beyond the prompt SGLang answers 400 with these words. (SGLang ignores it without
    return_logprob.)"""
    value = -1 if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or value < -1:
        raise BadRequest(f"logprob_start_len must be -1 or an index into input_ids, got {value!r}")
    if value > input_length:
        raise BadRequest(
            f"req.logprob_start_len={value} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={input_length}. Please use a smaller logprob_start_len."
        )
    return None if value == -1 else value
