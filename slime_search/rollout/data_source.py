"""Prompt data for rollouts: Search-R1 parquet or jsonl rows, a seeded epoch order, and a resumable position.

The order of epoch e is a permutation drawn from a generator seeded with (seed, e). No global RNG is touched.
Resuming at (epoch, offset) reproduces exactly the prompts an uninterrupted run would have taken. Prompts given
back (taken by a rollout that a checkpoint cut off before training on it) are served first, in their order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slime_search.config.rollout import DataConfig


@dataclass(frozen=True)
class PromptItem:
    index: int  # row in the file
    prompt: str | list[dict[str, str]]
    label: Any
    metadata: dict[str, Any]


class DataSourceError(RuntimeError):
    """A data file could not be read; the message says what to do."""


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DataSourceError(f"{path}:{line_no}: not valid JSON ({err.msg})") from err
    return rows


def read_prompt_file(path: str | Path) -> list[dict[str, Any]]:
    """Read Search-R1 rows from parquet or jsonl."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        return read_jsonl(path)
    raise DataSourceError(f"unsupported prompt file {path}: expected .parquet or .jsonl")


def split_row_range(path: str) -> tuple[str, slice]:
    """slime's `FILE@[start:end]` (either bound optional) selects rows of a file; a plain path selects all."""
    import re

    match = re.fullmatch(r"(.+)@\[(-?\d*):(-?\d*)\]", str(path))
    if match is None:
        return str(path), slice(None)
    file, start, end = match.groups()
    return file, slice(int(start) if start else None, int(end) if end else None)


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    file, rows = split_row_range(str(path))
    if not Path(file).is_file():
        raise FileNotFoundError(f"prompt data not found: {file}")
    return read_prompt_file(file)[rows]


def count_rows(path: str | Path) -> int:
    """How many rows `load_rows(path)` returns, without reading a parquet file's rows (its footer holds the count)."""
    file, rows = split_row_range(str(path))
    if not Path(file).is_file():
        raise FileNotFoundError(f"prompt data not found: {file}")
    if Path(file).suffix == ".parquet":
        import pyarrow.parquet as pq

        total = pq.ParquetFile(file).metadata.num_rows
    else:
        total = len(read_prompt_file(file))
    return len(range(total)[rows])


class DataSource:
    def __init__(self, config: DataConfig, rows: list[dict[str, Any]] | None = None):
        self.config = config
        self.rows = rows if rows is not None else load_rows(config.path)
        if not self.rows:
            raise ValueError(f"{config.path} holds no rows")
        missing = [k for k in (config.input_key, config.label_key) if k not in self.rows[0]]
        if missing:
            raise KeyError(
                f"{config.path} rows lack {missing}; they have {sorted(self.rows[0])}: set --input-key / --label-key"
            )
        self.epoch = 0
        self.offset = 0
        self.given_back: list[int] = []  # row indices served before the epoch order goes on

    def __len__(self) -> int:
        return len(self.rows)

    def order(self, epoch: int) -> np.ndarray:
        if not self.config.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.config.seed, epoch]).permutation(len(self.rows))

    def item(self, row_index: int) -> PromptItem:
        row = self.rows[row_index]
        metadata = row.get(self.config.metadata_key) or {}
        metadata = {**metadata, "data_source": row.get("data_source")}
        return PromptItem(int(row_index), row[self.config.input_key], row[self.config.label_key], metadata)

    def take(self, count: int) -> list[PromptItem]:
        """The next `count` prompts: those given back first, then the epoch order, wrapping into the next epoch (with its
        own order) as needed."""
        items = []
        while self.given_back and len(items) < count:
            items.append(self.item(self.given_back.pop(0)))
        while len(items) < count:
            order = self.order(self.epoch)
            chunk = order[self.offset : self.offset + count - len(items)]
            items.extend(self.item(int(i)) for i in chunk)
            self.offset += len(chunk)
            if self.offset >= len(order):
                self.epoch, self.offset = self.epoch + 1, 0
        return items

    def state_dict(self, given_back: list[int] | tuple[int, ...] = ()) -> dict[str, Any]:
        """The position; `given_back`: rows taken but not trained on, to serve again first after a resume."""
        return {"epoch": self.epoch, "offset": self.offset, "given_back": [*given_back, *self.given_back]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self.given_back = [int(i) for i in state.get("given_back", [])]
