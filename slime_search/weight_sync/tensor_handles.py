"""Weight sync by tensor handles (SGLang's /update_weights_from_tensor), for engines that share the trainer's devices.

Nothing but handles crosses HTTP. Each trainer rank an engine sits on serializes a bucket of its HF-named tensors
(`slime_search.engines.weight_wire`). On GPU that is a flattened bucket of CUDA IPC handles; on CPU, shared memory. The
engine maps the same memory and copies from it. The pushes sit in SGLang's weight-update session.
`serialized_named_tensors` holds one entry per engine TP rank. A rank drops a bucket only once every engine has answered
for it (the rank's half: `slime_search.weight_sync.rank`).
"""

from __future__ import annotations

import asyncio

from slime_search.weight_sync.transport_base import WeightTransport, check_served, served_versions


def engine_payloads(entries: list[str | None], ranks_per_engine: list[int]) -> list[list[str]]:
    """Engine e takes the entries of the ranks it sits on: engines are laid over trainer ranks 0.. in order."""
    payloads, start = [], 0
    for k in ranks_per_engine:
        chunk = entries[start : start + k]
        if len(chunk) < k or any(entry is None for entry in chunk):
            raise ValueError(f"engines need the handles of {sum(ranks_per_engine)} trainer ranks, got {len(entries)}")
        payloads.append(chunk)
        start += k
    return payloads


async def post_bucket(url: str, entries: list[str], weight_version: str | None, load_format: str | None = None) -> dict:
    """One bucket to one engine; the bucket carrying `weight_version` (the last) also flushes its cache."""
    from slime_search.engines.client import call_engine, check_success

    payload = {
        "serialized_named_tensors": entries,
        "load_format": load_format,
        "flush_cache": weight_version is not None,
    }
    if weight_version is not None:
        payload["weight_version"] = weight_version
    answer = await call_engine(url, "post", "/update_weights_from_tensor", payload)
    return check_success(url, "update_weights_from_tensor", answer)


def next_bucket(group) -> tuple[list[str | None], str | None, bool]:
    """The next bucket's handles from every rank, their load_format, and whether it is the last bucket."""
    answers = group.on_all_ranks("next_weight_handles")
    lasts = {last for _, _, last in answers}
    if len(lasts) != 1:
        raise RuntimeError("trainer ranks disagree on where the weights end; their models differ")
    formats = {load_format for entry, load_format, _ in answers if entry is not None}
    return [entry for entry, _, _ in answers], (formats.pop() if formats else None), lasts.pop()


class TensorHandleTransport(WeightTransport):
    uses_update_session = True

    def push(self, version: str) -> str:
        """Bucket after bucket from the trainer ranks the engines sit on to those engines."""
        from slime_search.engines.client import on_every_engine

        ranks_per_engine = self.ranks_per_engine
        serving_ranks = sum(ranks_per_engine)
        if serving_ranks > self.group.config.num_ranks:
            raise ValueError(
                f"engines sit on {serving_ranks} trainer ranks but there are {self.group.config.num_ranks}"
            )

        async def post_all(payloads: list[list[str]], load_format: str | None, bucket_version: str | None) -> None:
            payload_of = dict(zip(self.engine_urls, payloads, strict=True))
            await on_every_engine(
                self.engine_urls, lambda url: post_bucket(url, payload_of[url], bucket_version, load_format)
            )

        self.group.on_all_ranks("prepare_weight_handles", self.config.bucket_bytes, serving_ranks)
        try:
            with self.update_session():
                last = False
                while not last:
                    entries, load_format, last = next_bucket(self.group)
                    payloads = engine_payloads(entries, ranks_per_engine)
                    asyncio.run(post_all(payloads, load_format, version if last else None))
        finally:
            self.group.on_all_ranks("finish_weight_handles")
        return check_served(asyncio.run(served_versions(self.engine_urls)), version)
