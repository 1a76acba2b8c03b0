"""Graded rows (one per question, the table's input) from evaluated samples, or from trajectories graded as they stand
by the reward plugin: a published run's outputs, another harness's, or this project's own `.samples.jsonl`.

A trajectory row needs a response, its golden answers (`golden_answers`, or the label under --label-key) and its set
(`data_source` or `dataset`); its `id` (else its line in the file) names the question, so two runs can be paired on
it. An evaluated sample's question is its data row: extra_info's split and index (Search-R1's schema), else its row
in the evaluated file. Never the prompt alone: two questions can share one (PopQA has 14 such pairs in 1,000).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from slime_search.evaluation.subsets import ROW_KEY, SET_SIZE_KEY
from slime_search.evaluation.table import graded_row
from slime_search.types import Sample, Status

LABEL_KEYS = ("golden_answers", "label", "reward_model")
SOURCE_KEYS = ("data_source", "dataset")


def question_key(prompt: Any) -> str:
    """A question's prompt text (chat messages as JSON): what it was asked, not which question it is."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def question_id(metadata: dict) -> str | None:
    """Which question of its set a sample answers: its data row's own index (with its split: an index may restart
    in each), else its row in the file it was read from; None when neither is known."""
    if metadata.get("index") is not None:
        split = metadata.get("split")
        return f"{split}:{metadata['index']}" if split is not None else str(metadata["index"])
    return None if metadata.get(ROW_KEY) is None else str(metadata[ROW_KEY])


def reward_numbers(reward: float | dict | None, reward_key: str) -> dict[str, float]:
    """The numeric entries of a reward (booleans as 0/1); a plain number is named by the reward key."""
    if reward is None:
        return {}
    if not isinstance(reward, dict):
        return {reward_key: float(reward)}
    return {key: float(value) for key, value in reward.items() if isinstance(value, (int, float))}


def rows_from_samples(samples: list[Sample], reward_key: str = "score") -> list[dict]:
    """One graded row per evaluated sample (a sample never rewarded scores 0 on every key)."""
    return [
        graded_row(
            str(s.metadata.get("data_source") or "all"),
            question_key(s.prompt),
            reward_numbers(s.reward, reward_key),
            s.metrics,
            s.metadata.get(SET_SIZE_KEY),
            question_id(s.metadata),
        )
        for s in samples
    ]


def sample_from_trajectory(row: dict, label_key: str | None = None, line: int | None = None) -> Sample:
    """A completed sample of a trajectory row, ready for the reward plugin; its question is named by the row's id,
    else by its `line` in the file."""
    keys = (label_key, *LABEL_KEYS) if label_key else LABEL_KEYS
    label = next((row[k] for k in keys if k in row), None)
    source = next((row[k] for k in SOURCE_KEYS if row.get(k)), None)
    missing = [name for name, value in (("response", row.get("response")), ("label", label), ("set", source)) if value is None]  # fmt: skip
    if missing:
        raise ValueError(
            f"a trajectory row needs a response, golden answers ({' / '.join(keys)}) and a set "
            f"({' / '.join(SOURCE_KEYS)}); this one lacks {missing}: it has {sorted(row)}"
        )
    sample = Sample(
        prompt=row.get("prompt") or row.get("question", ""),
        response=row["response"],
        label=label,
        status=Status.COMPLETED,
    )
    sample.metadata["data_source"] = str(source)
    sample.metadata[ROW_KEY] = row.get("id", line)
    return sample


def read_samples(path: str | Path, reward, args: Any, label_key: str | None = None) -> list[Sample]:
    """The samples of a file: this project's evaluated samples as they were graded, or trajectory rows graded now by
    `reward` (the reward plugin, `async reward(args, sample)`)."""
    with open(path) as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    if not rows:
        raise ValueError(f"{path} holds no rows")
    if all("reward" in row and "tokens" in row for row in rows):  # a `.samples.jsonl` of this project
        return [Sample.from_dict(row) for row in rows]
    samples = []
    for number, row in enumerate(rows, 1):
        try:
            samples.append(sample_from_trajectory(row, label_key, number))
        except ValueError as err:
            raise ValueError(f"{path}:{number}: {err}") from None

    async def grade_all():
        return await asyncio.gather(*(reward(args, sample) for sample in samples))

    for sample, reward_value in zip(samples, asyncio.run(grade_all()), strict=True):
        sample.reward = reward_value
    return samples
