"""SGLang's weight-update session around a push, on two real CPU engine servers: an engine that refuses to begin
leaves no other engine locked in a session, and a failed push's error is never replaced by a failed end."""

import httpx
import pytest

from slime_search.engines.client import EngineError
from slime_search.utils.server_process import ServerProcess
from slime_search.weight_sync.transport_base import weight_update_session

pytestmark = pytest.mark.timeout(300)


def engine_argv(checkpoint):
    argv = ["-m", "slime_search.engines.cpu_engine_server", "--model-path", str(checkpoint), "--port", "0"]
    return [*argv, "--weight-version", "0"]


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    first = ServerProcess(engine_argv(tiny_checkpoint), wait=False)
    second = ServerProcess(engine_argv(tiny_checkpoint), wait=False)
    with first, second:
        first.wait_ready()
        second.wait_ready()
        yield first.url, second.url


@pytest.fixture
def urls(engines):
    yield engines
    for url in engines:  # no session left open for the next test (400 when none is: fine)
        httpx.post(f"{url}/end_weight_update", json={}, timeout=30)


def begin(url: str) -> httpx.Response:
    return httpx.post(f"{url}/begin_weight_update", json={}, timeout=30)


def test_a_refused_begin_ends_the_sessions_that_did_begin_and_names_the_engine(urls):
    free, busy = urls
    assert begin(busy).status_code == 200  # someone else's session is open on the second engine
    pushed = []
    with pytest.raises(EngineError, match="already open") as refused, weight_update_session([free, busy]):
        pushed.append(True)
    assert not pushed  # nothing is pushed without a session on every engine
    assert begin(free).status_code == 200  # the engine that began was not left locked in its session
    assert busy in str(refused.value)


def test_a_failed_push_is_the_error_raised_even_when_the_end_fails(urls, caplog):
    first, second = urls
    with pytest.raises(ValueError, match="bucket 3 did not arrive") as failed, weight_update_session([first, second]):
        httpx.post(f"{first}/end_weight_update", json={}, timeout=30)  # so the session's own end fails there
        raise ValueError("bucket 3 did not arrive")
    notes = " ".join(getattr(failed.value, "__notes__", []))
    assert "did not end" in notes and first in notes
    assert first in caplog.text  # the failed end is also logged
    assert begin(second).status_code == 200  # the other engine's session was ended all the same


def test_a_failed_end_after_a_good_push_is_raised(urls):
    first, second = urls
    with (
        pytest.raises(EngineError, match="no weight-update session is open") as failed,
        weight_update_session([first, second]),
    ):
        httpx.post(f"{second}/end_weight_update", json={}, timeout=30)
    assert second in str(failed.value)
    assert begin(first).status_code == 200
