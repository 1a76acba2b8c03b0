"""What Serper may have billed stays counted: every attempt, an answer whose caller was cancelled afterwards; only an
attempt that certainly never reached Serper's billing is given back. Identical queries in flight are sent once. The
ledger refuses a filesystem whose locks it cannot trust, and closes its connections. (Serper stand-in on 127.0.0.1.)"""

import asyncio
import os
import sqlite3

import httpx
import pytest

from slime_search.search_r1 import serper_budget
from slime_search.search_r1.config import search_r1_args
from slime_search.search_r1.generate import preflight
from slime_search.search_r1.search_clients import SearchError, SerperClient, SerperConfig
from slime_search.search_r1.serper_budget import (
    SerperBudget,
    SpendLedger,
    check_ledger_filesystem,
    mount_of,
    unreliable_lock_mount,
)
from slime_search.utils.net import free_port
from tests.search_r1.conftest import SERPER_KEY

pytestmark = pytest.mark.timeout(300)
KEY = SERPER_KEY  # the key the shared stand-in accepts (conftest.py)


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", KEY)
    return tmp_path / "run" / "serper_spend.sqlite"


async def calls_of(server, query: str) -> int:
    answer = await asyncio.to_thread(httpx.get, f"{server.url}/health")
    return answer.json()["calls"].get(query, 0)


def client_for(server, ledger, **overrides) -> SerperClient:
    settings = {"endpoint": f"{server.url}/search", "backoff_base_s": 0.01, "page_timeout_s": 5.0, **overrides}
    return SerperClient(SerperConfig(**settings), budget=SerperBudget(max_calls=100, ledger_path=str(ledger)))


def run(coroutine_fn, *args):
    return asyncio.run(coroutine_fn(*args))


def test_every_attempt_counts_and_only_one_that_never_reached_billing_is_given_back(serper, ledger, monkeypatch):
    async def search(client, query):
        try:
            return await client.search(query)
        except SearchError as err:
            return err
        finally:
            await client.close()

    # Each timed-out attempt reached Serper, which may have answered (and billed) after the client gave up.
    timed_out = run(search, client_for(serper, ledger, timeout_s=0.5, retries=2), "wait 2 timed out")
    assert isinstance(timed_out, SearchError) and run(calls_of, serper, "wait 2 timed out") == 3
    assert SpendLedger(ledger).spent() == 3
    # A 5xx may have been billed too: Serper documents no refund for it.
    assert isinstance(run(search, client_for(serper, ledger, retries=1), "down"), SearchError)
    assert SpendLedger(ledger).spent() == 5
    # A refused connection sent nothing, and a refused key cannot be billed: both given back.
    closed = SerperClient(
        SerperConfig(endpoint=f"http://127.0.0.1:{free_port()}/search", backoff_base_s=0.01, retries=2),
        budget=SerperBudget(max_calls=100, ledger_path=str(ledger)),
    )
    assert "ClientConnectorError" in str(run(search, closed, "never sent"))
    monkeypatch.setenv("SERPER_API_KEY", "a key Serper does not know")
    assert "HTTP 403" in str(run(search, client_for(serper, ledger), "unauthorised"))
    assert SpendLedger(ledger).spent() == 5
    # The cap holds per attempt: with one call left, a search that needs a retry stops at its second attempt.
    monkeypatch.setenv("SERPER_API_KEY", KEY)
    capped = SerperClient(
        SerperConfig(endpoint=f"{serper.url}/search", backoff_base_s=0.01, timeout_s=0.5, retries=3),
        budget=SerperBudget(max_calls=6, ledger_path=str(ledger)),
    )
    assert "budget is spent" in str(run(search, capped, "wait 2 capped"))
    assert run(calls_of, serper, "wait 2 capped") == 1 and SpendLedger(ledger).spent() == 6


def test_a_billed_answer_stays_counted_when_its_trajectory_is_cancelled_afterwards(serper, ledger):
    """Serper answered (billed); the page fetches after it hang on /page/slow; the rollout cancels the trajectory."""

    async def cancelled_after_the_answer():
        client = client_for(serper, ledger, topk=4, snippet_only=False)
        try:
            search = asyncio.create_task(client.search("billed then cancelled"))
            while await calls_of(serper, "billed then cancelled") == 0:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # the answer is back; the slow page is being fetched
            assert not search.done()
            search.cancel()
            with pytest.raises(asyncio.CancelledError):
                await search
            await asyncio.sleep(0.1)
            return dict(client._in_flight)
        finally:
            await client.close()

    assert run(cancelled_after_the_answer) == {}  # no one waits on it: the search itself was cancelled
    assert SpendLedger(ledger).spent() == 1


def test_identical_queries_in_flight_are_sent_once_and_the_answer_shared(serper, ledger):
    async def group(share: bool, variants: list[str]):
        client = client_for(serper, ledger, share_in_flight=share)
        try:
            return await asyncio.gather(*(client.search_with_origin(query) for query in variants))
        finally:
            await client.close()

    # GRPO's samples of one prompt, opening with the same query (written a little differently: one key)
    query = "wait 1 grpo first query"
    answers = run(group, True, [query, query.upper(), f"  {query} ", query.replace(" ", "  "), query])
    assert run(calls_of, serper, "wait 1 grpo first query") == 1 and SpendLedger(ledger).spent() == 1
    assert all(docs == answers[0][0] and docs for docs, _ in answers)
    assert sorted(origin for _, origin in answers) == ["api", "shared", "shared", "shared", "shared"]
    # Without sharing, each sample would have been sent and billed.
    run(group, False, ["wait 1 unshared query", " wait 1 unshared query", "wait 1  unshared query"])
    assert run(calls_of, serper, "wait 1 unshared query") == 3 and SpendLedger(ledger).spent() == 4


def test_a_cancelled_waiter_leaves_the_shared_search_to_the_others_and_a_failure_reaches_all(serper, ledger):
    async def scenario():
        client = client_for(serper, ledger, retries=0)
        try:
            first, *others = [asyncio.create_task(client.search("wait 1 cancel one")) for _ in range(3)]
            await asyncio.sleep(0.3)
            first.cancel()  # the trajectory that sent it goes (a rollback, a stream stop)
            answers = await asyncio.gather(*others)
            with pytest.raises(asyncio.CancelledError):
                await first
            # The last waiter gone, its search is cancelled; a search of that query right after starts afresh.
            lone = asyncio.create_task(client.search("wait 0.5 asked again"))
            await asyncio.sleep(0.2)
            lone.cancel()
            await asyncio.sleep(0)  # the cancellation reaches the waiter, which abandons its flight
            again = await client.search("wait 0.5 asked again")
            assert again and lone.cancelled()
            failures = await asyncio.gather(*(client.search("wait 0.5 down") for _ in range(3)), return_exceptions=True)
            # Closing the client while a search is in flight answers its waiters rather than leaving them hanging.
            pending = [asyncio.create_task(client.search("wait 3 closed")) for _ in range(2)]
            await asyncio.sleep(0.3)
            await client.close()
            closed = await asyncio.gather(*pending, return_exceptions=True)
            return answers, failures, closed
        finally:
            await client.close()

    answers, failures, closed = run(scenario)
    assert len(answers) == 2 and answers[0] == answers[1] and answers[0]
    assert run(calls_of, serper, "wait 1 cancel one") == 1
    assert all(isinstance(f, SearchError) and "HTTP 500" in str(f) for f in failures)
    assert run(calls_of, serper, "wait 0.5 down") == 1
    assert all(isinstance(c, SearchError) and "client closed" in str(c) for c in closed)
    assert run(calls_of, serper, "wait 0.5 asked again") == 2
    assert SpendLedger(ledger).spent() == 5  # one call each, whatever became of the waiters


MOUNTS = r"""sysfs /sys sysfs rw,nosuid 0 0
/dev/sda1 / ext4 rw,relatime 0 0
fileserver:/export/runs /mnt/runs nfs4 rw,vers=4.2 0 0
/dev/nvme0n1 /mnt/runs/scratch xfs rw 0 0
10.0.0.1@tcp:/lfs /lustre lustre rw,flock 0 0
//nas/share /mnt/team\040share cifs rw 0 0
tmpfs /tmp tmpfs rw 0 0
"""


def test_the_filesystem_of_a_path_is_its_longest_mount_point():
    assert mount_of("/mnt/runs/exp1/serper_spend.sqlite", MOUNTS) == ("/mnt/runs", "nfs4")
    assert mount_of("/mnt/runs/scratch/exp1/serper_spend.sqlite", MOUNTS) == ("/mnt/runs/scratch", "xfs")
    assert mount_of("/mnt/runsold/serper_spend.sqlite", MOUNTS) == ("/", "ext4")  # a prefix, not a folder above
    assert mount_of("/mnt/team share/run/x", MOUNTS) == ("/mnt/team share", "cifs")
    assert unreliable_lock_mount("/lustre/user/run/x", MOUNTS) == ("/lustre", "lustre")
    assert unreliable_lock_mount("/mnt/runs/scratch/x", MOUNTS) is None
    assert unreliable_lock_mount("/home/user/run/x", MOUNTS) is None
    assert mount_of("/mnt/runs/x", MOUNTS + "other:/y /mnt/runs ext4 rw 0 0\n") == ("/mnt/runs", "ext4")  # mounted over


def test_a_run_folder_on_nfs_is_refused_at_start_naming_the_filesystem_and_the_way_out(tmp_path, monkeypatch):
    run_folder, local = tmp_path / "nfs_runs" / "run1", tmp_path / "local"
    table = tmp_path / "mounts"
    table.write_text(f"{MOUNTS}fileserver:/runs {os.path.realpath(tmp_path / 'nfs_runs')} nfs rw 0 0\n")
    monkeypatch.setattr(serper_budget, "MOUNTS_TABLE", str(table))
    monkeypatch.setenv("SERPER_API_KEY", KEY)
    budget = {"search_backend": "serper", "serper_budget_calls": 10}
    with pytest.raises(RuntimeError) as refused:
        preflight(search_r1_args(hf_checkpoint="ckpt", save=str(run_folder), **budget))
    assert "nfs filesystem" in str(refused.value) and "--serper-ledger" in str(refused.value)
    with pytest.raises(RuntimeError, match="nfs filesystem"):
        SpendLedger(run_folder / "serper_spend.sqlite")  # any process that would count there refuses too
    ledger = str(local / "serper_spend.sqlite")
    preflight(search_r1_args(hf_checkpoint="ckpt", save=str(run_folder), serper_ledger=ledger, **budget))
    preflight(search_r1_args(hf_checkpoint="ckpt", save=str(run_folder), search_backend="serper"))  # no budget
    check_ledger_filesystem(run_folder / "x", mounts_table=tmp_path / "no such table")  # not Linux: no check


def test_the_ledger_closes_every_connection_it_opens(tmp_path, monkeypatch):
    opened = []
    connect = sqlite3.connect

    def recording_connect(*args, **kwargs):
        opened.append(connect(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(sqlite3, "connect", recording_connect)
    ledger = SpendLedger(tmp_path / "spend.sqlite")
    assert ledger.reserve(5) and ledger.reserve(None)
    ledger.release()
    assert ledger.spent() == 1 and len(opened) == 5
    for db in opened:
        with pytest.raises(sqlite3.ProgrammingError, match="closed"):
            db.execute("SELECT 1")
