"""The instruments find the repository's run script and the shared data from where they live."""

from benchmarks.harness import paths
from benchmarks.perf import rollout_concurrency, rollout_overlap
from benchmarks.studies import async_modes, engine_death, eval_beside

REPO = paths.Path(__file__).resolve().parents[2]


def test_the_run_script_and_the_shared_data_are_found_from_the_benchmarks_folder():
    assert (
        async_modes.SCRIPT
        == engine_death.SCRIPT
        == eval_beside.SCRIPT
        == REPO / "examples" / "search-r1" / "run_miniature_cpu.sh"
    )
    assert async_modes.SCRIPT.is_file() and paths.RECIPE_SCRIPT.is_file() and paths.MODEL_SCRIPTS.is_dir()
    assert rollout_concurrency.SHARED == rollout_overlap.SHARED == REPO.parent / "shared" / "data"
