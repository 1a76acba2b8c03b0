"""Whole pages by URL for the page-access tool (ASearcher's and RLinf's `/access`), from `wiki_webpages.jsonl`.

The pages file (one JSON object a line with at least "url" and "contents"; ~6M Wikipedia pages) is memory-mapped like
the passage corpus. The URL index is two sorted int64 arrays (a hash of each URL, its row), saved beside the file. That
is 16 bytes a page instead of a Python dict holding every page, as ASearcher's server loads them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import numpy as np

from local_dense_retriever.corpus import Corpus


def normalize_page_url(url: str) -> str:
    """ASearcher's one rewrite: `.../index.php/Title` is the same page as `.../index.php?title=Title`."""
    return url.replace("index.php/", "index.php?title=") if "index.php/" in url else url


def url_key(url: str) -> int:
    """A 63-bit hash of the normalised URL (a collision is resolved by reading the rows: see PageStore.get)."""
    digest = hashlib.blake2b(normalize_page_url(url).encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def build_url_index(corpus: Corpus) -> np.ndarray:
    """[2, n] int64: URL keys sorted, and the row of each. Rows without a string "url" are left out."""
    keys, rows = [], []
    for row in range(len(corpus)):
        url = json.loads(corpus.raw(row)).get("url")
        if isinstance(url, str):
            keys.append(url_key(url))
            rows.append(row)
    keys_array, rows_array = np.asarray(keys, dtype=np.int64), np.asarray(rows, dtype=np.int64)
    order = np.argsort(keys_array, kind="stable")  # stable: of two rows with one URL, the earlier comes first
    return np.stack([keys_array[order], rows_array[order]])


class PageStore:
    def __init__(self, path: str | Path):
        self.corpus = Corpus(path)
        index_path = self.corpus.path.with_suffix(self.corpus.path.suffix + ".urls.npy")
        if index_path.is_file() and index_path.stat().st_mtime >= self.corpus.path.stat().st_mtime:
            self.index = np.load(index_path, mmap_mode="r")
        else:
            self.index = build_url_index(self.corpus)
            with contextlib.suppress(OSError):  # a read-only folder: the index stays in memory
                np.save(index_path, self.index)

    def __len__(self) -> int:
        return int(self.index.shape[1])

    def get(self, url: str) -> dict | None:
        """The page row whose URL is `url` (after normalisation), or None. Of two rows with one URL the last wins,
        as in ASearcher's dict."""
        wanted = normalize_page_url(url)
        key = url_key(url)
        keys = self.index[0]
        start = int(np.searchsorted(keys, key, side="left"))
        stop = int(np.searchsorted(keys, key, side="right"))
        found = None
        for position in range(start, stop):
            page = self.corpus[int(self.index[1][position])]
            if normalize_page_url(str(page.get("url", ""))) == wanted:
                found = page
        return found
