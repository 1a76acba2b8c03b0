"""Read FlashRAG-format QA sets (hub or local jsonl) and write Search-R1 parquet files."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from slime_search.rollout.data_source import DataSourceError, read_jsonl
from slime_search.search_r1.prompt import make_row

logger = logging.getLogger(__name__)

FLASHRAG_HUB_DATASET = "RUC-NLPIR/FlashRAG_datasets"
SEARCH_R1_TRAIN_SOURCES = ("nq", "hotpotqa")
SEARCH_R1_TEST_SOURCES = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
# Search-R1's test merge takes each set's test split, else dev, else train.
TEST_SPLIT_PREFERENCE = ("test", "dev", "train")


def find_local_file(local: list[str], source: str, splits: Iterable[str]) -> tuple[Path, str] | None:
    """Resolve a source among --local-jsonl entries: NAME=PATH pairs, or directories holding NAME_SPLIT*.jsonl."""
    splits = list(splits)
    for entry in local:
        name, sep, path = entry.partition("=")
        if sep and name == source:
            return Path(path), splits[0]
    for entry in local:
        if "=" in entry:
            continue
        directory = Path(entry)
        for split in splits:
            matches = sorted(directory.glob(f"{source}_{split}*.jsonl"))
            if matches:
                return matches[0], split
    return None


def load_from_hub(source: str, splits: Iterable[str]) -> tuple[list[dict[str, Any]], str]:
    """Load one FlashRAG set from the Hugging Face hub; the first available split of `splits` is used."""
    import datasets  # heavy: imported only when the hub is actually used

    try:
        dataset = datasets.load_dataset(FLASHRAG_HUB_DATASET, source)
    except Exception as err:  # noqa: BLE001 - any hub/network failure becomes one actionable line
        raise DataSourceError(
            f"cannot load {source!r} from the Hugging Face hub ({FLASHRAG_HUB_DATASET}): "
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}. "
            "Offline? Pass --local-jsonl DIR (files named like nq_test.jsonl) or --local-jsonl nq=PATH."
        ) from err
    for split in splits:
        if split in dataset:
            return [dict(row) for row in dataset[split]], split
    raise DataSourceError(f"{source!r} on the hub has none of the splits {list(splits)} (has {list(dataset)})")


def load_source(source: str, splits: Iterable[str], local: list[str]) -> tuple[list[dict[str, Any]], str]:
    splits = list(splits)
    if local:
        found = find_local_file(local, source, splits)
        if found is None:
            raise DataSourceError(
                f"no local file for {source!r}: expected {source}=PATH or a directory with "
                f"{source}_{{{','.join(splits)}}}*.jsonl among --local-jsonl {local}"
            )
        path, split = found
        if not path.is_file():
            raise DataSourceError(f"local file for {source!r} does not exist: {path}")
        logger.info("reading %s (%s split) from %s", source, split, path)
        return read_jsonl(path), split
    return load_from_hub(source, splits)


def build_rows(sources: Iterable[str], splits: Iterable[str], local: list[str], out_split: str, template: str):
    """Rows for all sources, in order; extra_info.index restarts at 0 for each source, as in Search-R1."""
    from tqdm import tqdm

    splits = list(splits)
    rows = []
    for source in sources:
        examples, _ = load_source(source, splits, local)
        for index, example in enumerate(tqdm(examples, desc=source, unit="q", leave=False)):
            rows.append(make_row(example, source, out_split, index, template))
    return rows


def write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not rows:
        raise DataSourceError(f"no rows to write to {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    tmp.replace(path)  # never leave a half-written parquet behind
