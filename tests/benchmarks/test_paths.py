"""The benchmarks find the repository's run script and the shared data from where they live."""

from pathlib import Path

from benchmarks import async_modes, engine_death, eval_beside, rollout_concurrency, rollout_overlap

REPO = Path(__file__).resolve().parents[2]


def test_the_run_script_and_the_shared_data_are_found_from_the_benchmarks_folder():
    assert (
        async_modes.SCRIPT
        == engine_death.SCRIPT
        == eval_beside.SCRIPT
        == REPO / "examples" / "search-r1" / "run_miniature_cpu.sh"
    )
    assert async_modes.SCRIPT.is_file()
    assert rollout_concurrency.SHARED == rollout_overlap.SHARED == REPO.parent / "shared" / "data"
