"""Download Search-R1's wiki-18 corpus and prebuilt e5 indexes from the Hugging Face hub, verified and assembled.

    python local_dense_retriever/download.py --save-path DIR                 # corpus + e5 Flat index (~60 GB)
    python local_dense_retriever/download.py --save-path DIR --variant hnsw64
    python local_dense_retriever/download.py --save-path DIR --variant corpus  # corpus only (then build BM25:
        python local_dense_retriever/build_index.py --retriever-name bm25 --corpus-path DIR/wiki-18.jsonl --save-dir DIR)

Interrupted downloads resume. Every file is checked against the hub's recorded size and sha256; index parts are
concatenated into one file (e5_Flat.index / e5_HNSW64.index) and the corpus is decompressed to wiki-18.jsonl.
Search-R1's own BM25 index is a Lucene (Pyserini, JVM) index; this project's BM25 is built from the corpus.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Artifact:
    repo_id: str
    files: tuple[str, ...]
    assembled: str  # the file the parts are joined into, or the decompressed name


CORPUS = Artifact("PeterJinGo/wiki-18-corpus", ("wiki-18.jsonl.gz",), "wiki-18.jsonl")
VARIANTS = {
    "flat": (CORPUS, Artifact("PeterJinGo/wiki-18-e5-index", ("part_aa", "part_ab"), "e5_Flat.index")),
    "hnsw64": (CORPUS, Artifact("PeterJinGo/wiki-18-e5-index-HNSW64", ("part_aa", "part_ab"), "e5_HNSW64.index")),
    "corpus": (CORPUS,),
}


class DownloadError(RuntimeError):
    """A download or check failed; the message says what to do."""


def sha256_of(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def verify(path: Path, size: int | None, sha256: str | None) -> None:
    actual = path.stat().st_size
    if size is not None and actual != size:
        raise DownloadError(f"{path.name}: {actual} bytes on disk, the hub records {size}; delete it and rerun")
    if sha256 is not None and sha256_of(path) != sha256:
        raise DownloadError(f"{path.name}: sha256 differs from the hub's record; delete it and rerun")


def concatenate(parts: list[Path], out: Path) -> None:
    """Join index parts in order; written to a temporary name first so a crash leaves no partial index."""
    tmp = out.with_name(out.name + ".partial")
    with open(tmp, "wb") as sink:
        for part in parts:
            with open(part, "rb") as source:
                shutil.copyfileobj(source, sink, length=1 << 24)
    expected = sum(p.stat().st_size for p in parts)
    if tmp.stat().st_size != expected:
        raise DownloadError(f"joined {out.name} has {tmp.stat().st_size} bytes, expected {expected}")
    tmp.replace(out)


def gunzip(source: Path, out: Path) -> None:
    tmp = out.with_name(out.name + ".partial")
    with gzip.open(source, "rb") as packed, open(tmp, "wb") as sink:
        shutil.copyfileobj(packed, sink, length=1 << 24)
    tmp.replace(out)


def hub_file_info(repo_id: str, files: tuple[str, ...]) -> dict[str, tuple[int | None, str | None]]:
    from huggingface_hub import HfApi

    infos = HfApi().get_paths_info(repo_id, list(files), repo_type="dataset")
    return {info.path: (info.size, info.lfs.sha256 if getattr(info, "lfs", None) else None) for info in infos}


def fetch(artifact: Artifact, save_path: Path, check_sha: bool) -> Path:
    from huggingface_hub import hf_hub_download

    out = save_path / artifact.assembled
    if out.is_file():
        logger.info("%s already assembled", out)
        return out
    info = hub_file_info(artifact.repo_id, artifact.files)
    downloaded = []
    for name in artifact.files:
        logger.info("downloading %s/%s", artifact.repo_id, name)
        path = Path(hf_hub_download(artifact.repo_id, name, repo_type="dataset", local_dir=str(save_path)))
        size, sha = info.get(name, (None, None))
        verify(path, size, sha if check_sha else None)
        downloaded.append(path)
    if artifact.assembled.endswith(".jsonl"):
        gunzip(downloaded[0], out)
    else:
        concatenate(downloaded, out)
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save-path", "--save_path", required=True)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="flat")
    parser.add_argument("--skip-sha256", action="store_true", help="check sizes only (hashing 60 GB takes minutes)")
    args = parser.parse_args(argv)
    save_path = Path(args.save_path)
    save_path.mkdir(parents=True, exist_ok=True)
    try:
        for artifact in VARIANTS[args.variant]:
            logger.info("ready: %s", fetch(artifact, save_path, check_sha=not args.skip_sha256))
    except DownloadError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - any hub or network failure becomes one actionable line
        first = str(err).splitlines()[0] if str(err) else ""
        print(
            f"error: cannot download from the Hugging Face hub ({type(err).__name__}: {first}). "
            "Check the network (or HF_ENDPOINT / HF_HUB_OFFLINE) and rerun; finished files are kept.",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
