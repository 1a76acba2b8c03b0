"""Log records of Ray actors: a warning logged inside a real actor lands in its file in the run folder and on the
driver's console; INFO lines reach the file only."""

import logging
import time

import pytest

from slime_search.utils.actor_logging import log_to_run_folder

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=True, configure_logging=False)
    yield ray
    ray.shutdown()


class Noisy:
    """Stands in for the RolloutManager: logs through the project's loggers, as the engine pool does."""

    def __init__(self, folder: str):
        log_to_run_folder(folder, "noisy")

    def report(self, warning: str) -> None:
        logger = logging.getLogger("slime_search.engines.pool")
        logger.debug("a debug line stays out")
        logger.info("pool of 2 engines")
        logger.warning(warning)


def test_a_warning_inside_an_actor_reaches_its_file_and_the_driver_console(ray_session, tmp_path, capfd):
    actor = ray_session.remote(num_cpus=0)(Noisy).remote(str(tmp_path / "run"))
    ray_session.get(actor.report.remote("engine http://127.0.0.1:1 marked down: refused"))
    text = (tmp_path / "run" / "noisy.log").read_text()
    assert "WARNING slime_search.engines.pool: engine http://127.0.0.1:1 marked down: refused" in text
    assert "INFO slime_search.engines.pool: pool of 2 engines" in text and "debug line" not in text
    seen = ""
    deadline = time.monotonic() + 60  # Ray forwards the actor's stderr to the driver asynchronously
    while "marked down" not in seen and time.monotonic() < deadline:
        time.sleep(0.5)
        seen += capfd.readouterr().err
    assert "marked down" in seen and "pool of 2 engines" not in seen
    ray_session.kill(actor)


def test_train_ranks_log_to_their_own_files(ray_session, tmp_path):
    from slime_search.ray.train_group import TrainRank

    rank = ray_session.remote(num_cpus=0)(TrainRank).remote(1, 2, 1, str(tmp_path))
    ray_session.get(rank.gpu_ids.remote())
    assert (tmp_path / "train_rank_1.log").is_file()
    ray_session.kill(rank)


def test_a_second_call_replaces_the_handlers_of_the_first(tmp_path, capsys):
    root = logging.getLogger()
    before = list(root.handlers), root.level
    try:
        log_to_run_folder(tmp_path, "first")
        path = log_to_run_folder(tmp_path, "second")
        logging.getLogger("slime_search.test").warning("only in the second file")
        assert "only in the second file" in path.read_text()
        assert "only in the second file" not in (tmp_path / "first.log").read_text()
        assert capsys.readouterr().err.count("only in the second file") == 1
    finally:
        for handler in [h for h in root.handlers if h not in before[0]]:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(before[1])
