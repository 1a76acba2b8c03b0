"""Build Search-R1's evaluation set: the 7 QA benchmarks (test split, else dev, else train) in one parquet file.

    python examples/search-r1/data_process/qa_search_test_merge.py --local-dir data/nq_hotpotqa_train
    # offline, from FlashRAG-format jsonl files such as ../shared/data/qa:
    python examples/search-r1/data_process/qa_search_test_merge.py --local-dir OUT --local-jsonl ../shared/data/qa

Writes OUT/test.parquet with Search-R1's schema and byte-identical prompts; data_source names the benchmark.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import parse_args, run  # noqa: E402

from slime_search.search_r1.qa_data import SEARCH_R1_TEST_SOURCES, TEST_SPLIT_PREFERENCE, build_rows  # noqa: E402

if __name__ == "__main__":
    args = parse_args(__doc__.splitlines()[0], SEARCH_R1_TEST_SOURCES, "data/nq_hotpotqa_train")
    sys.exit(run(build_rows, args, splits=TEST_SPLIT_PREFERENCE, out_split="test", filename="test.parquet"))
