"""What the Search-R1 task checks before anything starts: the retriever answers one query, or Serper has its key (or
its replay cache).

Without it a retriever that is down is found on the first search, after the engines started and the actor loaded its
weights, and every sample of the first rollout fails. The paid Serper API is never called here.
"""

from __future__ import annotations

import os
from pathlib import Path

from slime_search.search_r1.search_clients import SerperConfig

PROBE = {"queries": ["preflight"], "topk": 1, "return_scores": False}
START_HINT = (
    "start it first (python local_dense_retriever/retrieval_server.py --index-path INDEX --corpus-path CORPUS; see "
    "docs/retriever.md) or point --search-url at the /retrieve endpoint of a running one"
)


def check_retriever(url: str, timeout_s: float) -> None:
    """POST one query to the /retrieve endpoint `url`; RuntimeError naming the URL and what failed."""
    import httpx

    try:
        # No proxy from the environment: the rollout's search client (aiohttp) does not use one either.
        response = httpx.post(url, json=PROBE, timeout=timeout_s, trust_env=False)
    except httpx.TimeoutException:
        raise RuntimeError(
            f"the retriever at {url} did not answer one query within {timeout_s:g} s (--search-preflight-timeout)"
        ) from None
    except (httpx.HTTPError, httpx.InvalidURL) as err:
        raise RuntimeError(f"cannot reach the retriever at {url} ({type(err).__name__}: {err}); {START_HINT}") from None
    if response.status_code != 200:
        raise RuntimeError(
            f"the retriever at {url} answered HTTP {response.status_code} to one query ({response.text[:200]!r}); "
            "--search-url must be the /retrieve endpoint"
        )
    try:
        result = response.json().get("result")
    except (ValueError, AttributeError):
        result = None
    if not (isinstance(result, list) and len(result) == 1 and isinstance(result[0], list)):
        raise RuntimeError(
            f"the retriever at {url} did not answer Search-R1's /retrieve format ({{'result': [[documents]]}} for "
            f"one query): {response.text[:200]!r}"
        )


def check_serper(cache_path: str | None, replay_only: bool) -> None:
    """Serper's API key is in the environment, or, replaying, the cache file exists; RuntimeError otherwise."""
    if replay_only:
        if not cache_path or not Path(cache_path).is_file():
            raise RuntimeError(f"--serper-replay-only answers from --serper-cache, and {cache_path!r} is not a file")
        return
    key_env = SerperConfig().api_key_env
    if not os.environ.get(key_env):
        raise RuntimeError(
            f"--search-backend serper needs an API key in the environment variable {key_env} (or "
            "--serper-replay-only with a --serper-cache file)"
        )


def check_page_access(url: str, timeout_s: float) -> None:
    """POST one URL to the /access endpoint `url` (--page-access): RuntimeError when it is not there to answer."""
    import httpx

    try:
        response = httpx.post(url, json={"urls": ["preflight"]}, timeout=timeout_s, trust_env=False)
    except (httpx.HTTPError, httpx.InvalidURL) as err:
        raise RuntimeError(f"--page-access: cannot reach {url} ({type(err).__name__}: {err})") from None
    if response.status_code != 200:
        raise RuntimeError(
            f"--page-access: {url} answered HTTP {response.status_code} ({response.text[:200]!r}); start the "
            "retriever with --pages-path, or set --access-url"
        )
