"""Shared command-line handling of the two Search-R1 data scripts in this folder."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def parse_args(description: str, default_sources: tuple[str, ...], default_dir: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--local-dir", "--local_dir", default=default_dir, help="output folder")
    parser.add_argument(
        "--data-sources",
        "--data_sources",
        default=",".join(default_sources),
        help="comma-separated FlashRAG set names",
    )
    parser.add_argument("--template-type", "--template_type", default="base", help="prompt template")
    parser.add_argument(
        "--local-jsonl",
        action="append",
        default=[],
        metavar="DIR|NAME=PATH",
        help="read FlashRAG-format jsonl instead of the hub: a folder of NAME_SPLIT*.jsonl files, or NAME=PATH; "
        "repeatable",
    )
    return parser.parse_args()


def run(build, args: argparse.Namespace, splits: tuple[str, ...], out_split: str, filename: str) -> int:
    """Build and write one parquet file; a data error prints one line and exits 2, with no traceback."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from slime_search.rollout.data_source import DataSourceError
    from slime_search.search_r1.qa_data import write_parquet

    sources = [s.strip() for s in args.data_sources.split(",") if s.strip()]
    out = Path(args.local_dir) / filename
    try:
        rows = build(sources, splits, args.local_jsonl, out_split, args.template_type)
        write_parquet(rows, out)
    except (DataSourceError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    logging.getLogger(__name__).info("wrote %d rows from %s to %s", len(rows), ",".join(sources), out)
    return 0
