"""Shared test helpers: the location of the real data beside the checkout, skipped with a reason when absent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


COMPILED_PACKAGES = ("slime_search", "megatron_bridge", "local_dense_retriever", "benchmarks", "tools", "tests")


def pytest_configure(config) -> None:
    """Before the workers start (in the controller, or the one process without xdist): `compile_sources`, and one
    thread per process under two workers or more (`one_thread_per_process`)."""
    if not hasattr(config, "workerinput"):
        compile_sources()
        if getattr(config.option, "numprocesses", None) not in (None, 0, 1):
            one_thread_per_process(os.environ)


def one_thread_per_process(environ) -> None:
    """OMP_NUM_THREADS=1 for the workers and every process a test starts, unless it is set already. The workers
    keep the cores busy between them, so a process's intra-op threads only contend with the other worker's: the
    in-process torch tests took a third to a half less CPU with one thread each (docs/benchmarks/test_suite.md).
    Megatron ranks set their own (`TrainRank`)."""
    environ.setdefault("OMP_NUM_THREADS", "1")


def compile_sources(root: Path = REPO_ROOT, packages: tuple[str, ...] = COMPILED_PACKAGES) -> None:
    """Byte-compile the project's own packages. Python never caches bytecode where PYTHONDONTWRITEBYTECODE is set (this
    machine kind sets it), so each of the suite's hundreds of processes (drivers, Ray actors, engines, servers)
    compiled again the ~25,000 lines it imports: about 0.4 CPU-s a process. Cached bytecode is read whatever that
    variable says; py_compile writes it (into the ignored __pycache__ folders), again only for what changed."""
    import compileall
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()) as listing:
        compiled = [compileall.compile_dir(root / package, quiet=1) for package in packages]
    if not all(compiled):
        raise RuntimeError(f"a source file of the project does not compile:\n{listing.getvalue()[-2000:]}")


# session-scoped servers: their tests share one worker, so one server of each
SESSION_ENGINE_FIXTURES = {"sglang_engine", "sglang_qwen3_engine"}


SHARED_SCOPES = ("module", "class", "package")  # a fixture of these scopes is made once for the tests that share it


def xdist_group(item) -> str | None:
    """The worker group of a test under `--dist loadgroup`: every test of the session's SGLang engine together (one
    engine, not two; a fixture that asks for it by `request.getfixturevalue` marks its case `session_engine`); the
    tests of a package that use one of its package-scoped fixtures together, across its modules; the tests of a
    module together when they use a module- or class-scoped fixture (a trained run, a Ray session, an engine: made
    once); any other test alone (None), free to run beside its own module's tests on the
    other worker. A module whose whole-training tests share nothing no longer runs them one after
    another on one worker."""
    names = set(getattr(item, "fixturenames", ()))
    if SESSION_ENGINE_FIXTURES & names or item.get_closest_marker("session_engine") is not None:
        return "session-engine"
    definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    shared = [
        defs[-1] for name, defs in definitions.items() if name in names and defs and defs[-1].scope in SHARED_SCOPES
    ]
    package = next((d for d in shared if d.scope == "package"), None)
    if package is not None:  # made once for the tests of the package (its conftest's folder) that use it
        return f"package:{package.baseid}"
    if shared:
        return item.nodeid.split("::")[0]
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Under `-n N --dist loadgroup` (pytest-xdist): the slow modules first, and the groups of `xdist_group`. Runs
    before xdist reads them (tryfirst); without xdist the marks do nothing and the order is the same."""
    items[:] = slow_modules_first(items)
    for item in items:
        group = xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def slow_modules_first(items: list) -> list:
    """The modules with a test marked slow first, each module's tests together and in order: the workers take the
    long runs while there is other work to fill in beside them, instead of one long run last holding the suite."""
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow") is not None}
    return sorted(items, key=lambda item: item.nodeid.split("::")[0] not in slow)


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


@pytest.fixture(scope="session")
def tiny_qwen3_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Qwen3 policy (no q/k/v bias, q/k RMSNorm, head size 32 != 64 / 4), saved as an HF checkpoint."""
    from slime_search.models.tiny_qwen import TinyQwenConfig, save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"), TinyQwenConfig(family="qwen3"))


class SGLangEngine:
    """A real SGLang engine (CPU) shared by a test session; `reset()` gives it back the tiny checkpoint's weights at
    version "0" and closes a weight-update session a failed test may have left open."""

    def __init__(self, process, checkpoint: Path):
        self.process = process
        self.url = process.url
        self.checkpoint = checkpoint

    def reset(self) -> None:
        reset_engine(self.url, self.checkpoint)


def reset_engine(url: str, checkpoint: Path) -> None:
    """Give an engine (SGLang or the CPU engine) `checkpoint`'s weights at version "0", outside any weight-update
    session (a failed test may have left one open)."""
    import httpx

    httpx.post(f"{url}/end_weight_update", json={}, timeout=60)  # 400 when none is open: fine
    body = {"model_path": str(checkpoint), "weight_version": "0"}
    answer = httpx.post(f"{url}/update_weights_from_disk", json=body, timeout=300)
    assert answer.status_code == 200, answer.text


@pytest.fixture(scope="session")
def sglang_qwen3_engine(tiny_qwen3_checkpoint, tmp_path_factory) -> SGLangEngine:
    """Real SGLang serving the tiny Qwen3 checkpoint (q/k norms, its own head size, Qwen3's tokenizer) on CPU, one for
    the session (its tests share the session engine's worker): a start costs about 40 CPU-seconds, an idle engine
    about 1.5% of a core."""
    from slime_search.utils.net import free_port
    from tests import sglang_cpu

    log = tmp_path_factory.mktemp("sglang_qwen3") / "engine.log"
    process = sglang_cpu.start_engine(tiny_qwen3_checkpoint, free_port(), log_path=log)
    try:
        yield SGLangEngine(process, tiny_qwen3_checkpoint)
    finally:
        process.stop()


@pytest.fixture(scope="session")
def sglang_engine(tiny_checkpoint, tmp_path_factory) -> SGLangEngine:
    """Real SGLang serving the tiny checkpoint on this CPU machine (skipped without tests/sglang_cpu/setup.sh)."""
    from slime_search.utils.net import free_port
    from tests import sglang_cpu

    log = tmp_path_factory.mktemp("sglang") / "engine.log"
    process = sglang_cpu.start_engine(tiny_checkpoint, free_port(), log_path=log)
    try:
        yield SGLangEngine(process, tiny_checkpoint)
    finally:
        process.stop()
