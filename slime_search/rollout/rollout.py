"""One rollout: n samples per prompt through the generate and reward plugins, optional filtering of groups
without signal (with over-sampling to keep the batch full), and GRPO advantages by group.

What the plugins return is checked before it can reach the loss. A sample becomes FAILED when its engine log-probs are
not finite, when its reward is not a finite number (NaN, inf, None, a string), or when its reward plugin raised. The
reason goes in its metadata (`finish_reason`, `error`; for a plugin that raised, `error_kind`: whether the fault passes,
a service timing out, or comes back, a bug: slime_search.utils.faults) and leaves the loss, like a failed search; the
driver decides, by rate and kind, whether the step may train on the rest, waits the fault out, or stops.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from slime_search.algo import grpo_advantages
from slime_search.config.rollout import RolloutConfig
from slime_search.rollout.data_source import DataSource, PromptItem
from slime_search.types import Sample, Status
from slime_search.utils.faults import TRANSIENT, error_kind

logger = logging.getLogger(__name__)

GenerateFn = Callable[[Any, Sample, dict], Awaitable[Sample]]
RewardFn = Callable[..., Awaitable[float | dict]]


def reward_value(reward: float | dict, key: str) -> float:
    if isinstance(reward, dict):
        if key not in reward:
            raise KeyError(f"the reward plugin returned {sorted(reward)}; set --reward-key to one of them")
        return float(reward[key])
    return float(reward)


def plugin_name(function: Callable) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


def reward_problem(reward: Any, key: str) -> str | None:
    """Why a reward cannot train (None when it can): the training value, `reward[key]` of a dict, must be a real,
    finite number. A dict without `key` is a configuration error, raised as such."""
    value = reward
    if isinstance(reward, dict):
        if key not in reward:
            raise KeyError(f"the reward plugin returned {sorted(reward)}; set --reward-key to one of them")
        value = reward[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        return f"returned {value!r} ({type(value).__name__}), not a number"
    try:
        number = float(value)
    except (TypeError, ValueError) as err:
        return f"returned {value!r}, not a number ({err})"
    return None if math.isfinite(number) else f"returned {number}"


def fail(sample: Sample, reason: str, message: str) -> None:
    sample.status = Status.FAILED
    sample.metadata["finish_reason"] = reason
    sample.metadata["error"] = message
    logger.info("sample %s failed (%s): %s", sample.index, reason, message)


async def score(args, sample: Sample, reward: RewardFn, key: str) -> None:
    """Reward a generated sample, or fail it.

    Some results never reach the advantages: engine log-probs that are not finite, a reward that is not a finite
    number, or a reward plugin that raised (a judge endpoint timing out).
    """
    if not math.isfinite(sum(sample.rollout_log_probs)):  # one C-level pass; a NaN or inf anywhere survives the sum
        bad = sum(not math.isfinite(lp) for lp in sample.rollout_log_probs)
        fail(sample, "nonfinite_logprob", f"the engine returned {bad} log-probs that are not finite")
        return
    try:
        value = await reward(args, sample)
    except Exception as err:  # noqa: BLE001 - a plugin's fault costs its sample; the driver stops on a rate of them
        fail(
            sample,
            "reward_error",
            f"reward plugin {plugin_name(reward)} raised on sample {sample.index}: {type(err).__name__}: {err}",
        )
        sample.metadata["error_kind"] = error_kind(err)  # a service timing out passes; a bug in the plugin does not
        return
    problem = reward_problem(value, key)
    if problem is not None:
        fail(sample, "reward_error", f"reward plugin {plugin_name(reward)} {problem} for sample {sample.index}")
        return
    sample.reward = value


ATTEMPT_STRIDE = 2_654_435_761  # an odd multiplier (Knuth's): each attempt's seeds far from every other's


def attempt_params(params: dict, attempt: int) -> dict:
    """The run's sampling parameters for its `attempt`-th timeline (0, then one more after each rollback). The base
    `sampling_seed` moves with the attempt. So the steps redone after a rollback draw fresh trajectories instead of
    those of the steps they replace. With the same prompts, seeds and weights, the first redone step was the same, and a
    length blow-up came back step for step. A resumed run is on the same attempt, so it draws what it drew."""
    params = dict(params)
    if params.get("sampling_seed") is not None and attempt:
        params["sampling_seed"] = (params["sampling_seed"] + attempt * ATTEMPT_STRIDE) % (1 << 31)
    return params


def trajectory_params(params: dict, index: int) -> dict:
    """Sample `index`'s own sampling parameters. The run's base `sampling_seed` becomes a seed of this trajectory's own.
    So what it draws does not depend on which other requests an engine batched with it (on an engine that seeds its
    sampling: SGLang with deterministic inference, the CPU engine; others ignore the key)."""
    params = dict(params)
    if params.get("sampling_seed") is not None:
        params["sampling_seed"] = (params["sampling_seed"] * 1_000_003 + index) % (1 << 31)
    return params


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
    reward_key: str = "score",
) -> Sample:
    sample = Sample(prompt=item.prompt, label=item.label, group_index=group, index=index, metadata=dict(item.metadata))
    async with slots:
        sample = await generate(args, sample, trajectory_params(params, index))
    if sample.trainable:
        await score(args, sample, reward, reward_key)
    return done(sample)


def has_signal(group: list[Sample], key: str) -> bool:
    rewards = {reward_value(s.reward, key) for s in group if s.trainable}
    return len(rewards) > 1


def dropped_for_no_signal(group: list[Sample], key: str) -> bool:
    """--filter-zero-std's test: a group whose rewards are all equal teaches nothing and makes room for another.

    A group with a failed sample (a search or reward that failed) is kept whatever its rewards. Its failures must
    reach the health checks. Otherwise an outage would look like groups without signal and be refilled without end.
    """
    return not has_signal(group, key) and not any(s.status is Status.FAILED for s in group)


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
                            config.reward_key,
                        )
                        for j in range(config.n_samples_per_prompt)
                    )
                )
            )
            group_index += 1
            # One turn of the event loop per group: its samples prepare their first request and send it before the
            # next group is prepared. Started all at once, no request would leave before every sample of the batch
            # had been prepared (tokenised, its connection opened): seconds at thousands of samples, during which
            # the engines have nothing to do.
            await asyncio.sleep(0)
        for group in await asyncio.gather(*tasks):
            if config.filter_zero_std and dropped_for_no_signal(list(group), config.reward_key):
                dropped += 1
                continue
            kept.append(list(group))
        if not config.filter_zero_std:
            break
    return kept, batch_metrics(kept, dropped, config.reward_key)


def batch_metrics(groups: list[list[Sample]], dropped: int, reward_key: str) -> dict[str, float]:
    """What a batch of groups says before training on it. It counts groups kept and dropped, the share of groups without
    reward signal, failed samples by cause and truncations. It gives the reward's mean and spread, the mean of every
    other numeric key the reward plugin returns (format validity, EM, ...), and response lengths."""
    from slime_search.metrics import percentile

    samples = [s for g in groups for s in g]
    n = len(samples)
    causes = Counter(s.metadata.get("finish_reason") for s in samples if s.status is Status.FAILED)
    metrics = {
        "rollout/samples": float(n),
        "rollout/groups": float(len(groups)),
        "rollout/groups_dropped_zero_std": float(dropped),
        "rollout/zero_std_group_share": (dropped + sum(not has_signal(g, reward_key) for g in groups))
        / max(1, dropped + len(groups)),
        "rollout/failed": float(sum(causes.values())),
        "rollout/reward_errors": float(causes["reward_error"]),
        "rollout/reward_errors_transient": float(
            sum(s.metadata.get("error_kind") == TRANSIENT for s in samples if s.status is Status.FAILED)
        ),
        "rollout/nonfinite_log_probs": float(causes["nonfinite_logprob"]),
        "rollout/truncated": float(sum(s.status is Status.TRUNCATED for s in samples)),
        "rollout/truncation_rate": sum(s.status is Status.TRUNCATED for s in samples) / max(1, n),
        "rollout/trainable": 0.0,
    }
    trainable = [s for s in samples if s.trainable]
    if trainable:
        rewards = [reward_value(s.reward, reward_key) for s in trainable]
        mean = sum(rewards) / len(rewards)
        lengths = [s.response_length for s in trainable]
        metrics.update(
            {
                "rollout/trainable": float(len(trainable)),
                "rollout/reward_mean": mean,
                "rollout/reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
                "rollout/response_length_mean": sum(lengths) / len(lengths),
                "rollout/response_length_p50": percentile(lengths, 0.5),
                "rollout/response_length_p90": percentile(lengths, 0.9),
                "rollout/response_length_max": float(max(lengths)),
            }
        )
        metrics.update(reward_key_means(trainable, reward_key))
    return metrics


def reward_key_means(samples: list[Sample], reward_key: str) -> dict[str, float]:
    """rollout/reward_KEY: the mean of every other numeric key of dict rewards (Search-R1's em, f1, format_valid)."""
    totals: Counter[str] = Counter()
    for sample in samples:
        if isinstance(sample.reward, dict):
            for key, value in sample.reward.items():
                if key != reward_key and isinstance(value, (int, float)) and math.isfinite(value):
                    totals[key] += float(value)
    return {f"rollout/reward_{key}": total / len(samples) for key, total in sorted(totals.items())}


def first_errors(samples: list[Sample]) -> dict[str, str]:
    """The first error message of each cause among the failed and aborted samples (finish_reason -> message); an error
    of a fault that passes (a reward service timing out) under its cause with `_transient` added."""
    errors: dict[str, str] = {}
    for sample in samples:
        error = sample.metadata.get("error")
        if error and not sample.trainable:
            cause = str(sample.metadata.get("finish_reason", "error"))
            if sample.metadata.get("error_kind") == TRANSIENT:
                cause += "_transient"
            errors.setdefault(cause, str(error))
    return errors


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
