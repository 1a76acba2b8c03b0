"""The evaluation-beside-training benchmark at its smallest size: a tiny miniature (every phase a few steps, prepared
up to RL once for the package's smoke runs), its RL phase evaluated every step inside the step and then beside it;
the table of both runs printed."""

import re

import pytest

from benchmarks.studies.eval_beside import main
from tests.benchmarks.conftest import copy_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_both_ways_evaluate_and_print_their_figures(smallest_sft_start, tmp_path, capsys):
    run_dir = copy_of(smallest_sft_start, tmp_path / "run")
    assert main(["--run-dir", str(run_dir), "--smallest", "--heldout", "8", "--eval-interval", "1"]) == 0
    out = capsys.readouterr().out
    rows = {
        row.split(" | ")[0]: row for row in out.splitlines() if row.startswith("| inside") or row.startswith("| beside")
    }
    assert set(rows) == {"| inside", "| beside"}
    for where in ("inside", "beside"):
        [evals] = [line for line in out.splitlines() if line.startswith(f"{where} held-out EM by version")]
        assert len(re.findall(r"\bv\d+ \d\.\d{3}", evals)) >= 2  # evaluated at version 0 and after training
