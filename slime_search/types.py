"""The units of data that flow from rollout to training: one `Sample` per generated trajectory, and the
`TrainSample` the trainer takes of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Status(Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"  # hit a length budget before the model finished
    ABORTED = "aborted"  # cancelled by the rollout manager (e.g. over-sampling surplus)
    FAILED = "failed"  # an external fault (search outage, engine error): kept out of the loss


@dataclass
class Sample:
    """One trajectory: prompt tokens followed by response tokens.

    `tokens` holds prompt + response; the last `response_length` of them are the response. `loss_mask`,
    `rollout_log_probs` and `token_versions` cover the response only, one entry per response token: mask 1 for tokens
    the policy generated, 0 for tokens inserted by the environment (retrieved passages); log-probs are the engine's
    for generated tokens (of the distribution it sampled from) and 0.0 for inserted ones; versions are the weight
    version that generated each token (a trajectory can span a weight push) and -1 for inserted tokens or an engine
    that did not say.
    """

    Status = Status

    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    reward: float | dict[str, Any] | None = None
    label: Any = None
    group_index: int | None = None
    index: int | None = None
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    weight_versions: list[str] = field(default_factory=list)
    segments: list[tuple[str, bool]] = field(default_factory=list)  # response text spans: (text, generated)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[len(self.tokens) - self.response_length :]

    def append_response_tokens(
        self,
        token_ids: list[int],
        *,
        generated: bool,
        log_probs: list[float] | None = None,
        text: str = "",
        versions: list[int] | None = None,
    ) -> None:
        """Append a span of response tokens, keeping tokens, loss mask, log-probs and versions aligned.

        Generated spans need one log-prob per token and may give each token's weight version; inserted spans
        (observations) take neither and get mask 0, log-prob 0.0 and version -1.
        """
        self.check_alignment()
        token_ids = [int(t) for t in token_ids]
        if generated:
            if log_probs is None or len(log_probs) != len(token_ids):
                got = "none" if log_probs is None else len(log_probs)
                raise ValueError(f"generated span of {len(token_ids)} tokens needs as many log-probs, got {got}")
            span_log_probs = [float(lp) for lp in log_probs]
        else:
            if log_probs is not None or versions is not None:
                raise ValueError("inserted (non-generated) tokens take no log-probs or versions")
            span_log_probs = [0.0] * len(token_ids)
        if versions is not None and len(versions) != len(token_ids):
            raise ValueError(f"span of {len(token_ids)} tokens given {len(versions)} versions")
        self.tokens.extend(token_ids)
        self.loss_mask.extend([1 if generated else 0] * len(token_ids))
        self.rollout_log_probs.extend(span_log_probs)
        self.token_versions.extend([int(v) for v in versions] if versions is not None else [-1] * len(token_ids))
        self.response_length += len(token_ids)
        self.response += text
        self.segments.append((text, generated))

    def check_alignment(self) -> None:
        """Raise if the response, its mask and its log-probs disagree in length."""
        if self.response_length > len(self.tokens):
            raise ValueError(f"response_length {self.response_length} exceeds {len(self.tokens)} tokens")
        if len(self.loss_mask) != self.response_length:
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {self.response_length} response tokens")
        for name in ("rollout_log_probs", "token_versions"):
            if len(getattr(self, name)) != self.response_length:
                raise ValueError(
                    f"{name} has {len(getattr(self, name))} entries for {self.response_length} response tokens"
                )

    def generated_versions(self) -> list[int]:
        """The weight version of every generated token (-1 where the engine did not say)."""
        return [v for v, m in zip(self.token_versions, self.loss_mask, strict=True) if m]

    @property
    def trainable(self) -> bool:
        """Whether the sample may enter the loss: failed and aborted trajectories never do."""
        return self.status in (Status.COMPLETED, Status.TRUNCATED)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "tokens": list(self.tokens),
            "response": self.response,
            "response_length": self.response_length,
            "loss_mask": list(self.loss_mask),
            "rollout_log_probs": list(self.rollout_log_probs),
            "token_versions": list(self.token_versions),
            "reward": self.reward,
            "label": self.label,
            "group_index": self.group_index,
            "index": self.index,
            "status": self.status.value,
            "metadata": dict(self.metadata),
            "metrics": dict(self.metrics),
            "weight_versions": list(self.weight_versions),
            "segments": [list(seg) for seg in self.segments],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        fields = dict(data)
        fields["status"] = Status(fields.get("status", Status.PENDING.value))
        fields["segments"] = [(str(text), bool(generated)) for text, generated in fields.get("segments", [])]
        fields.setdefault("token_versions", [-1] * int(fields.get("response_length", 0)))  # records from before
        sample = cls(**fields)
        sample.check_alignment()
        return sample


@dataclass
class TrainSample:
    """What the trainer needs of a rollout sample; per-token lists cover the response only."""

    tokens: list[int]
    response_length: int
    loss_mask: list[int]
    advantage: float = 0.0
    rollout_log_probs: list[float] | None = None
    old_log_probs: list[float] | None = None
    ref_log_probs: list[float] | None = None
    token_versions: list[int] | None = None  # the weight version that generated each token (-1: inserted / unknown)

    @classmethod
    def from_sample(cls, sample: Sample) -> TrainSample:
        """The trainer's view of a scored sample (its GRPO advantage in metadata["advantage"])."""
        return cls(
            tokens=list(sample.tokens),
            response_length=sample.response_length,
            loss_mask=list(sample.loss_mask),
            advantage=float(sample.metadata.get("advantage", 0.0)),
            rollout_log_probs=list(sample.rollout_log_probs),
            token_versions=list(sample.token_versions),
        )
