"""One rollout: n samples per prompt through the generate and reward plugins, optional filtering of groups
without signal (with over-sampling to keep the batch full), and GRPO advantages by group.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from slime_search.algo import grpo_advantages
from slime_search.rollout.data_source import DataSource, PromptItem
from slime_search.types import Sample, Status

logger = logging.getLogger(__name__)

GenerateFn = Callable[[Any, Sample, dict], Awaitable[Sample]]
RewardFn = Callable[..., Awaitable[float | dict]]


@dataclass(frozen=True)
class RolloutConfig:
    batch_size: int  # prompts per rollout (--rollout-batch-size)
    n_samples_per_prompt: int = 8
    max_concurrency: int = 256  # samples in flight
    filter_zero_std: bool = False  # drop groups whose rewards are all equal (no GRPO signal)
    max_oversample_rounds: int = 4
    reward_key: str = "score"
    normalize_advantages_std: bool = True


def reward_value(reward: float | dict, key: str) -> float:
    if isinstance(reward, dict):
        if key not in reward:
            raise KeyError(f"the reward plugin returned {sorted(reward)}; set --reward-key to one of them")
        return float(reward[key])
    return float(reward)


async def _one_sample(
    args,
    item: PromptItem,
    group: int,
    index: int,
    generate: GenerateFn,
    reward: RewardFn,
    params: dict,
    slots: asyncio.Semaphore,
    done: Callable[[Sample], Sample],
) -> Sample:
    sample = Sample(prompt=item.prompt, label=item.label, group_index=group, index=index, metadata=dict(item.metadata))
    async with slots:
        sample = await generate(args, sample, dict(params))
    if sample.trainable:
        sample.reward = await reward(args, sample)
    return done(sample)


def has_signal(group: list[Sample], key: str) -> bool:
    rewards = {reward_value(s.reward, key) for s in group if s.trainable}
    return len(rewards) > 1


async def generate_rollout(
    args: Any,
    source: DataSource,
    config: RolloutConfig,
    generate: GenerateFn,
    reward: RewardFn,
    sampling_params: dict,
    first_group_index: int = 0,
    on_sample: Callable[[int, int], None] | None = None,
) -> tuple[list[list[Sample]], dict[str, float]]:
    """`batch_size` groups of samples (fewer only if over-sampling rounds run out); metrics of the rollout.

    `on_sample(done, total)` is called as samples finish (for a progress bar); total grows with over-sampling.
    """
    slots = asyncio.Semaphore(config.max_concurrency)
    kept: list[list[Sample]] = []
    group_index = first_group_index
    dropped = 0
    progress = [0, 0]

    def finished(sample: Sample) -> Sample:
        progress[0] += 1
        if on_sample is not None:
            on_sample(*progress)
        return sample

    for _ in range(config.max_oversample_rounds + 1):
        needed = config.batch_size - len(kept)
        if needed <= 0:
            break
        prompts = source.take(needed)
        progress[1] += len(prompts) * config.n_samples_per_prompt
        tasks = []
        for item in prompts:
            tasks.append(
                asyncio.gather(
                    *(
                        _one_sample(
                            args,
                            item,
                            group_index,
                            group_index * config.n_samples_per_prompt + j,
                            generate,
                            reward,
                            sampling_params,
                            slots,
                            finished,
                        )
                        for j in range(config.n_samples_per_prompt)
                    )
                )
            )
            group_index += 1
        for group in await asyncio.gather(*tasks):
            if config.filter_zero_std and not has_signal(list(group), config.reward_key):
                dropped += 1
                continue
            kept.append(list(group))
        if not config.filter_zero_std:
            break
    return kept, batch_metrics(kept, dropped, config.reward_key)


def batch_metrics(groups: list[list[Sample]], dropped: int, reward_key: str) -> dict[str, float]:
    """Groups kept and dropped, failures, truncations, mean reward and response length of a batch."""
    samples = [s for g in groups for s in g]
    metrics = {
        "rollout/groups": float(len(groups)),
        "rollout/groups_dropped_zero_std": float(dropped),
        "rollout/failed": float(sum(s.status is Status.FAILED for s in samples)),
        "rollout/truncated": float(sum(s.status is Status.TRUNCATED for s in samples)),
    }
    trainable = [s for s in samples if s.trainable]
    if trainable:
        metrics["rollout/reward_mean"] = sum(reward_value(s.reward, reward_key) for s in trainable) / len(trainable)
        metrics["rollout/response_length_mean"] = sum(s.response_length for s in trainable) / len(trainable)
    return metrics


def assign_advantages(samples: list[Sample], reward_key: str, normalize_std: bool = True) -> list[Sample]:
    """GRPO advantages over the trainable samples, grouped by group_index; returns those samples.

    Failed or aborted samples leave the loss and their group's statistics alike, so a group that lost members
    is normalised among its survivors.
    """
    trainable = [s for s in samples if s.trainable]
    if not trainable:
        return []
    rewards = torch.tensor([reward_value(s.reward, reward_key) for s in trainable])
    groups = torch.tensor([s.group_index for s in trainable])
    for sample, advantage in zip(
        trainable, grpo_advantages(rewards, groups, normalize_std=normalize_std).tolist(), strict=True
    ):
        sample.metadata["advantage"] = advantage
    return trainable
