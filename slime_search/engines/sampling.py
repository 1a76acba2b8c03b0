"""SGLang-compatible sampling parameters and per-row token sampling with the log-probs the trainer recomputes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # SGLang's: the detokenizer's spacing around special tokens
    ignore_eos: bool = False
    sampling_seed: int | None = None  # this request's own random stream (see seeded_uniform)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_request(cls, params: dict[str, Any] | None) -> SamplingParams:
        """Parse SGLang's `sampling_params` dict; unknown keys are kept in `extra`, bad values raise ValueError."""
        params = dict(params or {})
        known = {k: params.pop(k) for k in list(params) if k in cls.__dataclass_fields__ and k != "extra"}
        known = {k: v for k, v in known.items() if v is not None}  # SGLang: null means the default
        check_types(known)
        stop = known.get("stop") or ()
        known["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        known["stop_token_ids"] = tuple(known.get("stop_token_ids") or ())
        out = cls(**known, extra=params)
        out.validate()
        return out

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(value: Any) -> bool:
    """An integer a float64 and torch's int64 both hold exactly (larger ones overflow when tensors are built)."""
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) < 1 << 53


def _is_number(value: Any) -> bool:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


# The type each parameter must have; a wrong type raises TypeError before any comparison can.
_CHECKS = {
    "temperature": (_is_number, "a finite number"),
    "top_p": (_is_number, "a finite number"),
    "top_k": (_is_int, "an integer"),
    "max_new_tokens": (_is_int, "an integer"),
    "stop": (lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)),
             "a string or a list of strings"),
    "stop_token_ids": (lambda v: isinstance(v, list) and all(_is_int(t) and t >= 0 for t in v),
                       "a list of token ids"),
    "no_stop_trim": (lambda v: isinstance(v, bool), "a boolean"),
    "skip_special_tokens": (lambda v: isinstance(v, bool), "a boolean"),
    "spaces_between_special_tokens": (lambda v: isinstance(v, bool), "a boolean"),
    "ignore_eos": (lambda v: isinstance(v, bool), "a boolean"),
    "sampling_seed": (_is_int, "an integer"),
}  # fmt: skip


def check_types(params: dict[str, Any]) -> None:
    for key, value in params.items():
        valid, expected = _CHECKS[key]
        if not valid(value):
            raise TypeError(f"{key} must be {expected}, got {type(value).__name__} {str(value)[:40]}")


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and top-p nucleus (top_k <= 0 and top_p = 1 mean off)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device).expand_as(logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, logits.shape[-1])).unsqueeze(-1)
    drop = ranks >= k
    probs = torch.softmax(sorted_logits, dim=-1)
    # keep the smallest prefix whose mass reaches top_p: a token is dropped if the mass before it already does
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(-1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def seeded_uniform(seed: int, position: int) -> float:
    """The uniform draw of a request with `sampling_seed` for the token at `position` (tokens before it in its
    sequence).

    The draw comes from (seed, position), as in SGLang's seeded sampling (deterministic inference). So a request draws
    the same tokens from the same logits whichever requests share its batch. The same holds however its trajectory is
    split into turns or retracted and continued.
    """
    # splitmix64's finaliser over (seed, position): a few integer operations per token, no generator object
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)  # 53 random bits: a double in [0, 1)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    generator: torch.Generator | None = None,
    seeded: list[tuple[int, int] | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens, log-probs).

    A row whose `seeded` entry is (sampling_seed, position) draws seeded_uniform(...); the others draw from
    `generator`, a stream shared by the batch (so what they draw depends on which requests were batched together).

    The log-prob is log softmax(logits / T)[token] over the full vocabulary, the quantity the trainer recomputes
    from its own logits at the same temperature (top-p / top-k only restrict which tokens can be drawn). Greedy
    rows (T = 0) take the argmax and report log softmax(logits) at T = 1. A batch of greedy rows only draws no random
    number. So an evaluation between training steps leaves the engine's sampling stream as it was. A run evaluated
    inside its steps then trains as the same run evaluated beside them.
    """
    logits = logits.float()
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
    log_probs = torch.log_softmax(scaled, dim=-1)
    if bool(greedy.all()):
        tokens = logits.argmax(dim=-1)
        return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    candidates = log_probs
    if bool(((top_k > 0) | (top_p < 1)).any()):
        candidates = filter_top_k_top_p(log_probs, top_k, top_p)
    # Inverse-CDF draw with one uniform per row: on a 150k vocabulary this is ~6x cheaper on CPU than
    # torch.multinomial and ~5x cheaper than a Gumbel-max draw (which needs a random number per vocab entry).
    cdf = torch.cumsum(candidates.exp(), dim=-1)
    u = torch.rand((cdf.shape[0], 1), generator=generator)
    for row, key in enumerate(seeded or ()):
        if key is not None:
            u[row, 0] = seeded_uniform(*key)
    u = u * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_max(cdf.shape[-1] - 1)
    if bool(greedy.any()):
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
