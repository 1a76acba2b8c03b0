"""Weight sync of the adapters alone (--lora-sync-from-tensor), into SGLang's LoRA serving.

Under LoRA only the adapters change, so a push can carry them alone: at the 3B shape about 0.12 GB against 6.2 GB for the
weights with the adapters folded in (docs/benchmarks/lora.md). Actor rank 0 gathers them under PEFT's names into host
shared memory (`WeightSyncRank.adapter_payload`). Every engine loads them through /load_lora_adapter_from_tensors
under one name (`LoraConfig.served_adapter`). Every /generate names it in its `lora_path`. Each push unloads the
adapter of that name and loads the new one. No request is in flight then: synchronous and one-step modes drain the
rollout before a push. So no request meets the name missing. Then /update_weight_version sets the version the engines
report, as the other transports' last bucket does.

The engines load the HF folder's weights, and the adapters sit on them. An actor whose frozen base came from --load (a
torch_dist folder: an SFT run's, say) may hold another base. So its first push carries the base alone through
--update-weight-transport before the adapters (`push_base_first`). So does the first push after engines restart.

The engines must serve LoRA up to the adapters' rank: SGLang with LoRA on (`run_config.sglang_lora_args` for the
engines this project starts), or the CPU engine server, which always serves it. `connect` checks each one's
/server_info and refuses an engine that does not serve LoRA.
"""

from __future__ import annotations

import asyncio
import logging

from slime_search.weight_sync.transport_base import WeightTransport, check_served, served_versions

logger = logging.getLogger(__name__)


def lora_serving_problem(info: dict, lora_rank: int) -> str | None:
    """Why an engine with this /server_info cannot serve rank-`lora_rank` adapters from tensors, or None."""
    if not info.get("enable_lora"):
        return "it does not serve LoRA adapters (start SGLang with --enable-lora)"
    max_rank = info.get("max_lora_rank")
    if max_rank is not None and int(max_rank) < lora_rank:
        return f"its --max-lora-rank {max_rank} is below --lora-rank {lora_rank}"
    return None


async def replace_adapter(
    url: str, name: str, entries: list[str], adapter_config: dict, version: str, holds_it: bool
) -> None:
    """The engine's adapter `name` replaced by the one in `entries` (one serialized entry per engine TP rank), and
    `version` the weight version it reports. `holds_it`: the engine is known to hold an adapter of that name; one
    not known to (an engine started anew) may hold none, and its refused unload is passed over."""
    from slime_search.engines.client import EngineError, call_engine, check_success

    try:
        check_success(
            url, "unload_lora_adapter", await call_engine(url, "post", "/unload_lora_adapter", {"lora_name": name})
        )
    except EngineError:
        if holds_it:
            raise
    payload = {"lora_name": name, "config_dict": adapter_config, "serialized_named_tensors": entries}
    answer = await call_engine(url, "post", "/load_lora_adapter_from_tensors", payload)
    check_success(url, "load_lora_adapter_from_tensors", answer)
    update = {"new_version": version, "abort_all_requests": False}
    check_success(url, "update_weight_version", await call_engine(url, "post", "/update_weight_version", update))


class AdapterTransport(WeightTransport):
    def __init__(self, config, group, engine_urls: list[str], base: WeightTransport | None = None):
        """`base`: the transport that pushes the frozen base beneath the adapters (push_base_first), or None."""
        super().__init__(config, group, engine_urls)
        self.base = base
        self.base_due = False

    def connect(self) -> None:
        """Every engine must serve LoRA adapters of this rank; the first push loads the adapter (nothing to unload)."""
        from slime_search.engines.client import EngineError, call_engine, on_every_engine

        infos = asyncio.run(on_every_engine(self.engine_urls, lambda url: call_engine(url, "server_info")))
        problems = [
            f"{url}: {problem}"
            for url, info in zip(self.engine_urls, infos, strict=True)
            if (problem := lora_serving_problem(info, self.config.lora_rank)) is not None
        ]
        if problems:
            raise EngineError(f"--lora-sync-from-tensor: {'; '.join(problems)}")
        # The engines known to hold the adapter of the served name. Any other one may hold it or not (a running
        # engine given by --engine-url, one restarted): its unload may fail.
        self.loaded: set[str] = set()
        if self.base is not None:
            self.base.connect()
            self.base_due = True

    def close(self) -> None:
        if self.base is not None:
            self.base.close()

    def push(self, version: str) -> str:
        """The adapters from actor rank 0 to every engine, under the served name (the base first when it is due);
        returns the version served."""
        from slime_search.engines.client import on_every_engine

        if self.base_due:
            self.group.on_all_ranks("set_base_only", True)
            try:
                self.base.push(version)
            finally:
                self.group.on_all_ranks("set_base_only", False)
            self.base_due = False
            logger.info("pushed the frozen base beneath the adapters as version %s", version)
        answers = self.group.on_all_ranks("adapter_payload")
        try:
            entry, adapter_config, size = answers[0]
            entries = [entry] * self.config.ranks_per_engine  # each engine TP rank reads its own copy
            name = self.config.served_adapter

            async def load(url: str) -> None:
                held = url in self.loaded
                self.loaded.discard(url)  # until its new adapter is in: a failed load leaves it holding none
                await replace_adapter(url, name, entries, adapter_config, version, held)
                self.loaded.add(url)

            asyncio.run(on_every_engine(self.engine_urls, load))
        finally:
            self.group.on_all_ranks("finish_adapter_payload")
        logger.debug("pushed %d bytes of adapters as version %s", size, version)
        return check_served(asyncio.run(served_versions(self.engine_urls)), version)
