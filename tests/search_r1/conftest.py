"""The Serper stand-in (tests/search_r1/serper_standin.py, a real HTTP server on 127.0.0.1) that the web-search tests
share, one per module, and the key it accepts."""

import pytest

from slime_search.utils.server_process import ServerProcess
from tests.conftest import REPO_ROOT

SERPER_KEY = "test-secret-key-123"


@pytest.fixture(scope="module")
def serper():
    with ServerProcess(
        [str(REPO_ROOT / "tests" / "search_r1" / "serper_standin.py"), "--port", "0", "--api-key", SERPER_KEY]
    ) as server:
        yield server
