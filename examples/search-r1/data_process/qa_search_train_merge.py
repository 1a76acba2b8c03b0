"""Build Search-R1's training set: NQ + HotpotQA train splits merged into one parquet file.

    python examples/search-r1/data_process/qa_search_train_merge.py --local-dir data/nq_hotpotqa_train
    # offline, from FlashRAG-format jsonl files (nq_train.jsonl, hotpotqa_train.jsonl in DIR):
    python examples/search-r1/data_process/qa_search_train_merge.py --local-dir OUT --local-jsonl DIR

Writes OUT/train.parquet with Search-R1's schema and byte-identical prompts.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import parse_args, run  # noqa: E402

from slime_search.search_r1.qa_data import SEARCH_R1_TRAIN_SOURCES, build_rows  # noqa: E402

if __name__ == "__main__":
    args = parse_args(__doc__.splitlines()[0], SEARCH_R1_TRAIN_SOURCES, "data/nq_hotpotqa_train")
    sys.exit(run(build_rows, args, splits=("train",), out_split="train", filename="train.parquet"))
