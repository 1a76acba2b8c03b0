"""slime's own files at a pinned commit (../shared/compat/slime-624b824, beside the checkout), and slime's plugin API
as this project serves it when slime is not installed."""

from __future__ import annotations

import importlib
import importlib.machinery
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import REPO_ROOT

SLIME_FILES = REPO_ROOT.parent / "shared" / "compat" / "slime-624b824"
SEARCH_R1 = SLIME_FILES / "examples" / "search-r1"
MIS = SLIME_FILES / "examples" / "train_infer_mismatch_helper"


def require_slime_files() -> Path:
    if not SLIME_FILES.is_dir():
        pytest.skip(f"slime's files {SLIME_FILES} are absent (they sit beside the checkout in the dev workspace)")
    return SLIME_FILES


@pytest.fixture
def slime_files() -> Path:
    return require_slime_files()


@pytest.fixture
def slime_api() -> SimpleNamespace:
    """slime's modules as a plugin imports them (this project's compatibility layer: slime is not installed here)."""
    from slime_search.compat import finder

    if importlib.machinery.PathFinder.find_spec("slime") is not None:
        pytest.skip("a real slime is installed: these tests are of the compatibility layer that stands in for it")
    finder.install()
    names = ("slime.utils.types", "slime.utils.http_utils", "slime.utils.misc", "slime.rollout.sglang_rollout",
             "slime.backends.megatron_utils.cp_utils")  # fmt: skip
    modules = {name.rsplit(".", 1)[1]: importlib.import_module(name) for name in names}
    assert finder.serves_slime()
    return SimpleNamespace(**modules)
