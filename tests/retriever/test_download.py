"""download.py: offline failure, verification and assembly (the hub itself is unreachable from tests)."""

import gzip
import hashlib
import os
import subprocess
import sys

import pytest

from local_dense_retriever.download import DownloadError, concatenate, gunzip, verify
from tests.conftest import REPO_ROOT


def test_offline_download_fails_with_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "local_dense_retriever" / "download.py"), "--save-path", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: cannot download from the Hugging Face hub")
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_verify_checks_size_and_sha256(tmp_path):
    path = tmp_path / "part_aa"
    path.write_bytes(b"abc" * 100)
    verify(path, 300, hashlib.sha256(b"abc" * 100).hexdigest())
    with pytest.raises(DownloadError, match="300 bytes on disk, the hub records 301"):
        verify(path, 301, None)
    with pytest.raises(DownloadError, match="sha256 differs"):
        verify(path, 300, "0" * 64)


def test_concatenate_and_gunzip_assemble_complete_files(tmp_path):
    parts = [tmp_path / "part_aa", tmp_path / "part_ab"]
    parts[0].write_bytes(b"first-")
    parts[1].write_bytes(b"second")
    concatenate(parts, tmp_path / "e5_Flat.index")
    assert (tmp_path / "e5_Flat.index").read_bytes() == b"first-second"
    assert not (tmp_path / "e5_Flat.index.partial").exists()
    with gzip.open(tmp_path / "wiki-18.jsonl.gz", "wb") as handle:
        handle.write(b'{"id": "0", "contents": "x"}\n')
    gunzip(tmp_path / "wiki-18.jsonl.gz", tmp_path / "wiki-18.jsonl")
    assert (tmp_path / "wiki-18.jsonl").read_text() == '{"id": "0", "contents": "x"}\n'
