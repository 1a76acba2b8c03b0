"""Shared test helpers: the location of the real data beside the checkout, skipped with a reason when absent."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data folder {SHARED_DATA} is absent (it sits beside the checkout in the dev workspace)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Qwen2 policy with the real Qwen2 tokenizer, saved as an HF checkpoint (built once)."""
    from slime_search.models.tiny_qwen import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"))
