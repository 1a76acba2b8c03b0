"""A `{"id","contents"}` jsonl corpus with O(1) lookup by row, without loading passages as Python objects.

The jsonl file is memory-mapped and an offsets array (one int64 per line, saved beside the index) gives each
row's byte range. For wiki-18 (21M passages) that is 170 MB of offsets instead of tens of GB of dicts.
"""

from __future__ import annotations

import contextlib
import json
import mmap
from collections.abc import Iterator
from pathlib import Path

import numpy as np


def compute_offsets(path: Path) -> np.ndarray:
    """Byte offset of every non-empty line, plus the end of the file as a final sentinel."""
    offsets = []
    position = 0
    with open(path, "rb") as handle:
        for line in handle:
            if line.strip():
                offsets.append(position)
            position += len(line)
    offsets.append(position)
    return np.asarray(offsets, dtype=np.int64)


class Corpus:
    def __init__(self, path: str | Path, offsets_path: str | Path | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"corpus file not found: {self.path}")
        offsets_path = Path(offsets_path) if offsets_path else self.path.with_suffix(self.path.suffix + ".offsets.npy")
        if offsets_path.is_file() and offsets_path.stat().st_mtime >= self.path.stat().st_mtime:
            self.offsets = np.load(offsets_path, mmap_mode="r")
        else:
            self.offsets = compute_offsets(self.path)
            with contextlib.suppress(OSError):  # a read-only corpus folder: keep the offsets in memory only
                np.save(offsets_path, self.offsets)
        self._file = open(self.path, "rb")  # noqa: SIM115 - held open for the mmap's lifetime
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def raw(self, row: int) -> bytes:
        if not 0 <= row < len(self):
            raise IndexError(f"row {row} out of range for a corpus of {len(self)} passages")
        return self._map[int(self.offsets[row]) : int(self.offsets[row + 1])]

    def __getitem__(self, row: int) -> dict:
        return json.loads(self.raw(row))

    def iter_contents(self, start: int = 0, stop: int | None = None) -> Iterator[str]:
        for row in range(start, len(self) if stop is None else min(stop, len(self))):
            yield self[row]["contents"]

    def close(self) -> None:
        self._map.close()
        self._file.close()
