"""Where the instruments find the repository, its run scripts and the shared data beside the checkout."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"  # ../shared/data: real QA sets, passages and Search-R1 trajectories
MINIATURE_SCRIPT = REPO / "examples" / "search-r1" / "run_miniature_cpu.sh"
RECIPE_SCRIPT = REPO / "examples" / "search-r1" / "run_qwen2.5_3B.sh"
MODEL_SCRIPTS = REPO / "scripts" / "models"
