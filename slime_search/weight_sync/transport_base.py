"""What every weight transport shares: its settings, the base class, SGLang's weight-update session, and the check
that every engine serves the pushed version. The registry that picks a transport by name is `transports.py`; the
transports (`disk.py`, `broadcast.py`, `tensor_handles.py`) import this module only, so none imports another.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

logger = logging.getLogger(__name__)
TRANSPORT_NAMES = ("disk", "nccl", "tensor")  # the registry's (transports.TRANSPORTS) names, in order


@dataclass(frozen=True)
class WeightSyncConfig:
    transport: str  # one of TRANSPORT_NAMES
    bucket_bytes: int = 512 * 1024**2  # --update-weight-buffer-size
    hf_checkpoint: str = ""  # the original HF folder: config and tokenizer of a checkpoint written to disk
    disk_dir: str = ""  # where the disk transport writes its copies (only the newest is kept)
    ranks_per_engine: int = 1  # process-group ranks (GPUs) of one engine
    served_adapter: str | None = None  # --lora-sync-from-tensor: the adapters alone, served under this name
    lora_rank: int = 0  # the adapters' rank (an engine must serve at least this --max-lora-rank)
    # --lora-sync-from-tensor with --load: the frozen base may differ from the HF folder the engines load, so the first
    # push (and the first after engines restart) carries the base by `transport`, beneath the adapters
    push_base_first: bool = False

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORT_NAMES:
            raise ValueError(f"unknown weight transport {self.transport!r}; valid: {', '.join(TRANSPORT_NAMES)}")
        if self.bucket_bytes <= 0:
            raise ValueError("--update-weight-buffer-size must be a positive number of bytes")


class WeightTransport:
    """connect() once before the first push, push(version) after every step (returns the version every engine then
    serves), close() at the end of the run."""

    # Whether its updates are SGLang's tensor or distributed ones, which engines from 0.5.21 on accept only inside a
    # weight-update session (/begin_weight_update ... /end_weight_update).
    uses_update_session = False

    def __init__(self, config: WeightSyncConfig, group, engine_urls: list[str]):
        self.config = config
        self.group = group  # RayTrainGroup: on_all_ranks(method, *args) runs a WeightSyncRank method on every rank
        self.engine_urls = list(engine_urls)
        self.session_urls: list[str] = []  # the engines whose SGLang version needs the session

    @property
    def ranks_per_engine(self) -> list[int]:
        return [self.config.ranks_per_engine] * len(self.engine_urls)

    def connect(self) -> None:
        """Set up what every push needs; learn which engines need a weight-update session."""
        if self.uses_update_session:
            from slime_search.engines.client import needs_update_session

            versions = asyncio.run(engine_versions(self.engine_urls))
            self.session_urls = [
                url for url, v in zip(self.engine_urls, versions, strict=True) if needs_update_session(v)
            ]

    def update_session(self):
        """The weight-update session of one push, on the engines that need one."""
        return weight_update_session(self.session_urls)

    def push(self, version: str) -> str:
        raise NotImplementedError

    def close(self) -> None:
        """Undo connect()."""

    def reconnect(self) -> None:
        """Connect again after engines were restarted on their addresses (a broadcast group is formed anew; the
        restarted engines answer to their new SGLang version)."""
        self.close()
        self.connect()


async def session_call_on_each(urls: list[str], method: str) -> list[BaseException | None]:
    """`method` (begin_weight_update or end_weight_update) on every engine at once; per engine, None or the error,
    which names the engine. Every call runs to its end, so it is known which engines hold a session."""
    from slime_search.engines.client import EngineError, call_engine, check_success

    async def one(url: str) -> None:
        try:
            answer = await call_engine(url, method)
        except EngineError as err:  # an HTTP error status says which call failed, not on which engine
            raise EngineError(f"engine {url}: {err}", err.status, err.timed_out) from err
        check_success(url, method, answer)

    return list(await asyncio.gather(*(one(url) for url in urls), return_exceptions=True))


def first_failure(failures: list[BaseException | None]) -> BaseException | None:
    """The first error, with the others' messages added as notes so none is lost."""
    errors = [err for err in failures if err is not None]
    for other in errors[1:]:
        errors[0].add_note(str(other))
    return errors[0] if errors else None


@contextmanager
def weight_update_session(urls: list[str]) -> Iterator[None]:
    """SGLang's weight-update session on these engines around a push; closed also when the push fails, so the engines
    never stay locked in it. An engine that refuses to begin fails the session before the push, after the engines
    that did begin have ended theirs; an end that fails after a failed push is added to the push's error as a note
    and logged, so the push's error is the one raised."""
    begun = asyncio.run(session_call_on_each(urls, "begin_weight_update"))
    refused = first_failure(begun)
    if refused is not None:
        opened = [url for url, err in zip(urls, begun, strict=True) if err is None]
        for err in asyncio.run(session_call_on_each(opened, "end_weight_update")):
            if err is not None:
                logger.warning("after a refused begin_weight_update: %s", err)
        raise refused
    try:
        yield
    except BaseException as push_error:
        ended = first_failure(asyncio.run(session_call_on_each(urls, "end_weight_update")))
        if ended is not None:
            logger.warning("end_weight_update after a failed push: %s", ended)
            push_error.add_note(f"and the weight-update session did not end: {ended}")
        raise
    ended = first_failure(asyncio.run(session_call_on_each(urls, "end_weight_update")))
    if ended is not None:
        raise ended


def check_served(served: list[str], version: str) -> str:
    """Every engine must serve `version` after its push."""
    from slime_search.engines.client import EngineError

    if not served or any(v != version for v in served):
        raise EngineError(f"engines serve weight versions {served} after the push of version {version}")
    return version


async def served_versions(urls: list[str]) -> list[str]:
    """The weight version each engine serves (GET /model_info)."""
    from slime_search.engines.client import call_engine, on_every_engine

    return await on_every_engine(urls, lambda url: call_engine(url, "weight_version"))


async def engine_versions(urls: list[str]) -> list[str]:
    """The SGLang version each engine reports (GET /server_info)."""
    from slime_search.engines.client import call_engine, on_every_engine

    return await on_every_engine(urls, lambda url: call_engine(url, "version"))
