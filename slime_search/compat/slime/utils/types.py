"""slime.utils.types.Sample: slime's sample, with its fields, defaults, statuses and `append_response_tokens`.

The semantics are slime's (THUDM/slime at 624b824). The response-side lists (`loss_mask`, `rollout_log_probs`, the top-p
replay spans) stay aligned with `response_length`. Model tokens need log-probs. Tool tokens get mask 0 and log-prob 0.0.
SGLang's `meta_info` sets the status from its finish reason. `Sample.Status` is this project's status enum (its members
and values are slime's), so a status needs no mapping. Routed-experts replay (MoE) is refused: this project trains dense
models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from slime.utils.misc import decode_int32_meta_array

from slime_search.types import Status

TOP_P_TOKEN_ID_KEYS = ("top_p_token_ids", "top_p_kept_token_ids")
TOP_P_TOKEN_OFFSET_KEYS = ("top_p_token_offsets", "top_p_kept_token_offsets")


def int_list(values) -> list[int]:
    if values is None:
        return []
    if torch.is_tensor(values):
        values = values.detach().cpu().reshape(-1).tolist()
    return [int(v) for v in values]


def float_list(values) -> list[float] | None:
    if values is None:
        return None
    if torch.is_tensor(values):
        values = values.detach().cpu().reshape(-1).tolist()
    return [float(v) for v in values]


def as_int32(values, empty: list[int]) -> torch.Tensor:
    return torch.as_tensor(empty if values is None else values, dtype=torch.int32).reshape(-1)


def top_p_spans(meta_info: dict[str, Any], token_count: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The nucleus replay SGLang sent for a span: (kept token ids, offsets), offsets[i]:offsets[i + 1] being token i's
    ids; None when the span has none."""
    ids = decode_int32_meta_array(meta_info, TOP_P_TOKEN_ID_KEYS)
    offsets = decode_int32_meta_array(meta_info, TOP_P_TOKEN_OFFSET_KEYS)
    if ids is None and offsets is None:
        return None
    if ids is None or offsets is None:
        raise ValueError("SGLang top-p token replay must include both token ids and offsets.")
    if offsets.numel() == 0 or int(offsets[0]) != 0:
        raise ValueError(f"SGLang top-p token offsets must start with 0, got {offsets[:1].tolist()}.")
    if int(offsets[-1]) != ids.numel():
        raise ValueError(f"SGLang top-p token ids/offsets mismatch: offsets[-1]={int(offsets[-1])}, ids={ids.numel()}.")
    if token_count is not None and offsets.numel() != token_count + 1:
        raise ValueError(
            f"SGLang top-p token offsets length must equal generated token count + 1: {offsets.numel()} for "
            f"{token_count} tokens."
        )
    return ids, offsets


@dataclass
class Sample:
    """The sample generated (slime's fields, in slime's order, with slime's defaults)."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None  # None: the pipeline uses `index`
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | torch.Tensor | None = None
    rollout_top_p_token_offsets: list[int] | torch.Tensor | None = None
    rollout_routed_experts: list[list[int]] | torch.Tensor | None = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None

    Status = Status

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    @dataclass
    class SpecInfo:
        """Speculative decoding counts summed over a trajectory's turns."""

        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

        @property
        def spec_accept_rate(self) -> float:
            return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num > 0 else 0.0

        @property
        def spec_accept_length(self) -> float:
            return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct > 0 else 0.0

        def add(self, meta_info: dict) -> None:
            self.spec_accept_token_num += meta_info.get("spec_accept_token_num", 0)
            self.spec_draft_token_num += meta_info.get("spec_draft_token_num", 0)
            self.spec_verify_ct += meta_info.get("spec_verify_ct", 0)
            self.completion_token_num += meta_info.get("completion_tokens", 0)

        def to_dict(self) -> dict:
            return dict(self.__dict__)

        @staticmethod
        def from_dict(data: dict) -> Sample.SpecInfo:
            names = Sample.SpecInfo.__dataclass_fields__
            return Sample.SpecInfo(**{name: data.get(name, 0) for name in names})

    spec_info: SpecInfo = field(default_factory=SpecInfo)

    @dataclass
    class PrefixCacheInfo:
        """Prompt tokens SGLang's prefix cache served, summed over a trajectory's turns."""

        cached_tokens: int = 0
        total_prompt_tokens: int = 0

        @property
        def prefix_cache_hit_rate(self) -> float:
            return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens > 0 else 0.0

        def add(self, meta_info: dict) -> None:
            self.cached_tokens += meta_info.get("cached_tokens", 0)
            self.total_prompt_tokens += meta_info.get("prompt_tokens", 0)

        def to_dict(self) -> dict:
            return dict(self.__dict__)

        @staticmethod
        def from_dict(data: dict) -> Sample.PrefixCacheInfo:
            names = Sample.PrefixCacheInfo.__dataclass_fields__
            return Sample.PrefixCacheInfo(**{name: data.get(name, 0) for name in names})

    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    def to_dict(self) -> dict:
        """Every attribute (extra ones a plugin set too), the status as its value and the nested infos as dicts."""
        value = dict(self.__dict__)
        value["status"] = self.status.value
        value["spec_info"] = self.spec_info.to_dict()
        value["prefix_cache_info"] = self.prefix_cache_info.to_dict()
        return value

    @staticmethod
    def from_dict(data: dict) -> Sample:
        data = dict(data)
        data["status"] = Sample.Status(data["status"])
        data["spec_info"] = Sample.SpecInfo.from_dict(data.get("spec_info", {}))
        data["prefix_cache_info"] = Sample.PrefixCacheInfo.from_dict(data.get("prefix_cache_info", {}))
        names = Sample.__dataclass_fields__
        sample = Sample(**{k: v for k, v in data.items() if k in names})
        for key, value in data.items():
            if key not in names:
                setattr(sample, key, value)
        return sample

    def get_reward_value(self, args) -> float:
        return self.reward if not args.reward_key else self.reward[args.reward_key]

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def append_response_tokens(
        self,
        args=None,
        *,
        tokens=None,
        log_probs=None,
        trainable: bool = True,
        meta_info: dict | None = None,
        text: str | None = None,
        update_terminal_info: bool = True,
    ) -> None:
        """Append response tokens and keep the training lists aligned with them.

        Model tokens: `trainable=True` with their rollout log-probs (and SGLang's `meta_info`). Tool or environment
        tokens: `trainable=False`, no log-probs; they get mask 0, log-prob 0.0 and empty top-p spans.
        """
        tokens, log_probs = int_list(tokens), float_list(log_probs)
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"log_probs length {len(log_probs)} != tokens length {len(tokens)}")
        if tokens and trainable and log_probs is None:
            raise ValueError("trainable response tokens require rollout log probabilities.")
        if tokens and not trainable:
            if log_probs is not None:
                raise ValueError("non-trainable response tokens should not pass rollout log probabilities.")
            log_probs = [0.0] * len(tokens)
        if text is not None:
            self.response += text

        before = self.response_length
        if tokens:
            self.tokens += tokens
            self.response_length += len(tokens)
            if self.loss_mask is None:  # a response so far without a mask is trained on whole
                self.loss_mask = [1] * before
            self.loss_mask += [1 if trainable else 0] * len(tokens)
        if log_probs is not None:
            if self.rollout_log_probs is None:
                if trainable and before:
                    raise ValueError(
                        "Cannot append trainable rollout log probabilities to a sample with existing response tokens "
                        "but no existing rollout_log_probs."
                    )
                self.rollout_log_probs = [0.0] * before
            self.rollout_log_probs += log_probs

        pad_top_p = bool(tokens) and not trainable
        if meta_info is not None or pad_top_p:
            self._apply_meta_info(
                args,
                meta_info or {},
                new_token_count=len(tokens),
                pad_missing_top_p=pad_top_p,
                update_terminal_info=update_terminal_info,
            )
        self._validate_response_metadata_lengths()

    def _apply_meta_info(
        self,
        args,
        meta_info: dict,
        *,
        new_token_count: int = 0,
        pad_missing_top_p: bool = False,
        update_terminal_info: bool = True,
    ) -> None:
        spans = top_p_spans(meta_info, new_token_count) if new_token_count else None
        if spans is not None:
            self._extend_top_p(*spans)
        elif pad_missing_top_p and new_token_count and self.rollout_top_p_token_offsets is not None:
            self._extend_top_p(torch.zeros(0, dtype=torch.int32), torch.zeros(new_token_count + 1, dtype=torch.int32))
        if decode_int32_meta_array(meta_info, "routed_experts") is not None:
            raise ValueError("routed-experts replay (MoE routing) is not supported: this project trains dense models")
        if not update_terminal_info or "finish_reason" not in meta_info:
            return
        if getattr(args, "sglang_speculative_algorithm", False):
            self.spec_info.add(meta_info=meta_info)
        self.prefix_cache_info.add(meta_info=meta_info)
        if "weight_version" in meta_info:
            self.weight_versions.append(meta_info["weight_version"])
        status = {"length": Status.TRUNCATED, "abort": Status.ABORTED, "stop": Status.COMPLETED}
        self.status = status.get(meta_info["finish_reason"]["type"], self.status)

    def _extend_top_p(self, ids: torch.Tensor, offsets: torch.Tensor) -> None:
        """Append a span's kept ids and offsets (offsets relative to the span, starting at 0)."""
        if self.rollout_top_p_token_ids is None and self.rollout_top_p_token_offsets is None:
            self.rollout_top_p_token_ids, self.rollout_top_p_token_offsets = ids, offsets
            return
        if self.rollout_top_p_token_ids is None or self.rollout_top_p_token_offsets is None:
            raise ValueError("rollout top-p replay must include both token ids and offsets.")
        base_ids = as_int32(self.rollout_top_p_token_ids, [])
        base_offsets = as_int32(self.rollout_top_p_token_offsets, [0])
        if base_offsets.numel() == 0:
            raise ValueError("Cannot append top-p spans to empty offsets.")
        self.rollout_top_p_token_ids = torch.cat([base_ids, ids])
        self.rollout_top_p_token_offsets = torch.cat([base_offsets, offsets[1:] + int(base_offsets[-1])])

    def _validate_response_metadata_lengths(self) -> None:
        if self.loss_mask is not None and len(self.loss_mask) != self.response_length:
            raise ValueError(f"loss_mask length {len(self.loss_mask)} != response_length {self.response_length}")
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != self.response_length:
            raise ValueError(
                f"rollout_log_probs length {len(self.rollout_log_probs)} != response_length {self.response_length}"
            )
        if self.rollout_top_p_token_ids is None and self.rollout_top_p_token_offsets is None:
            return
        if self.rollout_top_p_token_ids is None or self.rollout_top_p_token_offsets is None:
            raise ValueError("rollout top-p replay must include both token ids and offsets.")
        offsets = as_int32(self.rollout_top_p_token_offsets, [])
        if offsets.numel() != self.response_length + 1:
            raise ValueError(
                "rollout_top_p_token_offsets length must equal response_length + 1: "
                f"len(offsets)={offsets.numel()}, response_length={self.response_length}."
            )
        if int(offsets[-1]) != as_int32(self.rollout_top_p_token_ids, []).numel():
            raise ValueError("rollout top-p token ids/offsets mismatch.")
