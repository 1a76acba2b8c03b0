"""This project's samples as slime's, and slime's as this project's: the conversion at the plugin boundary.

A slime plugin gets a `slime.utils.types.Sample` made as slime's data source makes one (the prompt rendered with the
chat template under --apply-chat-template, the row's label, index and group) and returns one; what it returns becomes
a `SlimeTrajectory`, this project's `Sample` with slime's kept beside it for the reward plugin:

| slime | here |
|---|---|
| tokens, response_length, response, label, reward, group_index, index | the same |
| loss_mask (None: all 1, as slime trains it); remove_sample | loss_mask; remove_sample zeroes it |
| rollout_log_probs | rollout_log_probs; None is refused for a sample that trains (the trainer needs them) |
| status PENDING / COMPLETED / TRUNCATED / ABORTED / FAILED | the same status, but PENDING (a plugin that returned before generating) is FAILED |
| weight_versions (one per model turn) | weight_versions, and each generated token's version in token_versions |
| metadata | metadata, over this project's (data source, row) |

The prompt stays this project's (the data row's messages); the response's generated and inserted spans, decoded,
are its `segments`. slime's top-p replay and routed experts have no counterpart and stay on the slime sample.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from slime_search.types import Sample, Status

TRAINABLE = (Status.COMPLETED, Status.TRUNCATED)


@dataclass
class SlimeTrajectory(Sample):
    """A sample a slime plugin generated, with the slime sample it returned (what slime's reward plugin reads)."""

    slime_sample: Any = field(default=None, repr=False, compare=False)


def slime_prompt(prompt: str | list[dict[str, str]], args: Any, tokenizer) -> str | list[dict[str, str]]:
    """The prompt as slime's data source gives it to plugins: under --apply-chat-template the chat template's text
    (a string prompt taken as one user message), else the row's prompt unchanged."""
    if not getattr(args, "apply_chat_template", False):
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    kwargs = getattr(args, "apply_chat_template_kwargs", None) or {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def to_slime(sample: Sample, prompt: str | list[dict[str, str]], sample_class: type) -> Any:
    """`sample` as a slime sample of `sample_class`, its prompt `prompt` (slime_prompt). A sample without a response
    yet has slime's empty lists (None); slime's rollout gives every sample a session id."""
    has_response = sample.response_length > 0
    return sample_class(
        group_index=sample.group_index,
        index=sample.index,
        prompt=prompt,
        tokens=list(sample.tokens),
        response=sample.response,
        response_length=sample.response_length,
        label=sample.label,
        reward=sample.reward,
        loss_mask=list(sample.loss_mask) if has_response else None,
        weight_versions=list(sample.weight_versions),
        rollout_log_probs=list(sample.rollout_log_probs) if has_response else None,
        status=sample_class.Status(sample.status.value),
        metadata=dict(sample.metadata),
        session_id=str(uuid.uuid4()),
    )


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, stop, value) of each run of equal mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


def version_number(version: Any) -> int:
    return int(version) if str(version).isdigit() else -1


def token_versions(mask: list[int], weight_versions: list[str]) -> list[int]:
    """Each response token's weight version: slime records one per model turn, in order, so with one version per
    generated span each span gets its own; with a single version every generated token has it; otherwise (a plugin
    that recorded versions some other way) unknown, -1. Inserted tokens are -1."""
    spans = [(start, stop) for start, stop, value in runs(mask) if value]
    versions = [-1] * len(mask)
    if len(weight_versions) == len(spans):
        per_span = [version_number(v) for v in weight_versions]
    elif len(set(weight_versions)) == 1:
        per_span = [version_number(weight_versions[0])] * len(spans)
    else:
        return versions
    for (start, stop), version in zip(spans, per_span, strict=True):
        versions[start:stop] = [version] * (stop - start)
    return versions


def from_slime(view: Any, original: Sample, tokenizer, plugin: str) -> SlimeTrajectory:
    """What slime plugin `plugin` returned for `original`, as this project's sample; ValueError, naming the plugin,
    for a sample whose response lists disagree or that would train without the engine's log-probs."""
    tokens = [int(t) for t in view.tokens]
    n = int(view.response_length)
    if not 0 <= n <= len(tokens):
        raise ValueError(f"{plugin} returned response_length {n} for a sample of {len(tokens)} tokens")
    mask = [int(m) for m in view.loss_mask] if view.loss_mask is not None else [1] * n
    if getattr(view, "remove_sample", False):  # slime keeps it for its statistics but trains on none of it
        mask = [0] * n
    status = Status(view.status.value)
    log_probs = view.rollout_log_probs
    if log_probs is None:
        if status in TRAINABLE and any(mask):
            raise ValueError(
                f"{plugin} returned a sample without rollout_log_probs: the trainer needs the engine's log-prob of "
                "every generated token (have the plugin ask SGLang for them: return_logprob)"
            )
        log_probs = [0.0] * n
    for name, values in (("loss_mask", mask), ("rollout_log_probs", log_probs)):
        if len(values) != n:
            raise ValueError(f"{plugin} returned {name} of {len(values)} entries for a response of {n} tokens")
    response = tokens[len(tokens) - n :]
    metadata = {**original.metadata, **dict(view.metadata or {})}
    if status is Status.PENDING:
        status = Status.FAILED
        metadata.update(finish_reason="plugin_pending", error=f"{plugin} returned a sample that is still PENDING")
    elif status is Status.ABORTED:
        metadata.setdefault("finish_reason", "abort")
    weight_versions = [str(v) for v in view.weight_versions]
    spans = runs(mask)
    return SlimeTrajectory(
        prompt=original.prompt,
        tokens=tokens,
        response=view.response,
        response_length=n,
        loss_mask=mask,
        rollout_log_probs=[float(lp) for lp in log_probs],
        token_versions=token_versions(mask, weight_versions),
        reward=view.reward,
        label=view.label,
        group_index=original.group_index,
        index=original.index,
        status=status,
        metadata=metadata,
        metrics={"turns": sum(1 for _, _, value in spans if value)},
        weight_versions=weight_versions,
        segments=[(tokenizer.decode(response[start:stop]), bool(value)) for start, stop, value in spans],
        slime_sample=view,
    )
