"""slime.rollout.sglang_rollout: `GenerateState`, `get_model_url` and slime's default single-turn `generate`.

`GenerateState(args)` is slime's singleton: the first call builds it and every later call returns that instance. It
holds the HF tokenizer of --hf-checkpoint and the sampling parameters slime builds from the flags:
temperature (--rollout-temperature), top_p (--rollout-top-p), top_k (--rollout-top-k), max_new_tokens
(--rollout-max-response-len), stop (--rollout-stop), stop_token_ids (--rollout-stop-token-ids), skip_special_tokens
(--rollout-skip-special-tokens), and always no_stop_trim=True, spaces_between_special_tokens=False. slime also asks
SGLang for the top-p nucleus (custom_params) when --rollout-top-p < 1, for its trainer to replay; this project's
trainer does not replay it, so it is not asked for. No multimodal processor is loaded (`processor` is None).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import weakref
from argparse import Namespace
from typing import Any

from slime.utils.http_utils import get_rollout_num_engines, post
from slime.utils.misc import SingletonMeta
from slime.utils.types import Sample

__all__ = ["GenerateState", "generate", "get_model_url"]


def get_model_url(args: Namespace, model_name: str, endpoint: str = "/generate") -> str:
    """The router address of `model_name` (--sglang-config's routers), else the default router's."""
    routers = getattr(args, "sglang_model_routers", None)
    if routers and model_name in routers:
        ip, port = routers[model_name]
        return f"http://{ip}:{port}{endpoint}"
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}{endpoint}"


def sampling_params_from_args(args: Namespace) -> dict[str, Any]:
    """The sampling parameters slime's rollout sends with every training request."""
    return dict(
        temperature=args.rollout_temperature,
        top_p=args.rollout_top_p,
        top_k=args.rollout_top_k,
        max_new_tokens=args.rollout_max_response_len,
        stop=args.rollout_stop,
        stop_token_ids=args.rollout_stop_token_ids,
        skip_special_tokens=args.rollout_skip_special_tokens,
        no_stop_trim=True,
        spaces_between_special_tokens=False,
    )


class GenerateState(metaclass=SingletonMeta):
    """The global state of generation: tokenizer, sampling parameters, the request semaphore, dp-rank balancing."""

    def __init__(self, args: Namespace) -> None:
        from transformers import AutoTokenizer

        self.args = args
        self.tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
        self.processor = None
        self.sampling_params: dict[str, Any] = sampling_params_from_args(args)
        self.concurrency = args.sglang_server_concurrency * max(1, get_rollout_num_engines(args))
        self._semaphores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        if getattr(args, "sglang_enable_deterministic_inference", False):
            self.group_sampling_seeds = [args.rollout_seed + i for i in range(args.n_samples_per_prompt)]
        self.dp_counts = [0] * (getattr(args, "sglang_dp_size", None) or 1)
        self.dp_rank = 0
        self.reset()

    @property
    def semaphore(self) -> asyncio.Semaphore:
        """slime's bound on requests in flight, one per event loop (each rollout here runs in a loop of its own)."""
        loop = asyncio.get_running_loop()
        if loop not in self._semaphores:
            self._semaphores[loop] = asyncio.Semaphore(self.concurrency)
        return self._semaphores[loop]

    @contextlib.contextmanager
    def dp_rank_context(self):
        """The least busy SGLang data-parallel rank for the duration of a request."""
        least = min(self.dp_counts)
        rank = random.choice([i for i, count in enumerate(self.dp_counts) if count == least])
        self.dp_counts[rank] += 1
        self.dp_rank = rank
        try:
            yield rank
        finally:
            self.dp_counts[rank] -= 1

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings = set()
        self.aborted = False


async def generate(args: Namespace, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """slime's default generate: one request from the prompt's token ids (those already in `sample.tokens`, else the
    prompt text encoded), its tokens and log-probs appended as trainable; `sampling_params` is consumed."""
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    if sample.status not in (Sample.Status.PENDING, Sample.Status.ABORTED):
        raise AssertionError(f"Sample status is {sample.status}")
    prompt_ids = sample.tokens or state.tokenizer.encode(sample.prompt, add_special_tokens=False)
    sampling_params["max_new_tokens"] -= sample.response_length
    if sampling_params["max_new_tokens"] < 0:
        raise AssertionError(f"max_new_tokens: {sampling_params['max_new_tokens']} should not be less than 0")
    if sampling_params["max_new_tokens"] == 0:
        sample.status = Sample.Status.TRUNCATED
        return sample
    payload = {"sampling_params": sampling_params, "return_logprob": True, "input_ids": prompt_ids}
    if getattr(args, "use_rollout_routing_replay", False):
        payload["return_routed_experts"] = True
    if not sample.tokens:
        sample.tokens = list(prompt_ids)
    headers = None
    if sample.session_id and getattr(args, "router_policy", None) == "consistent_hashing":
        headers = {"X-SMG-Routing-Key": sample.session_id}
    output = await post(url, payload, headers=headers)
    pairs = output["meta_info"].get("output_token_logprobs") or []
    sample.append_response_tokens(
        args,
        tokens=[item[1] for item in pairs],
        log_probs=[item[0] for item in pairs],
        trainable=True,
        meta_info=output["meta_info"],
        text=output["text"],
    )
    return sample
