"""The plugin boundary for plugins written against slime: they get slime's samples and slime's flags.

A plugin is slime's when the module that defines it uses slime (it imported `slime` or a name from it); the loader
(slime_search.plugins.Plugins.load) then wraps it here, whichever slime serves it (a real install or
slime_search.compat's). The wrapped generate gets a slime sample (samples.to_slime). It gets the sampling parameters
slime would pass: GenerateState's, under the rollout's own (temperature, top_p, max_new_tokens, the trajectory's seed).
Its `args` carry slime's defaults for the slime flags this project does not declare (`SLIME_DEFAULTS`). They also carry
the engines' address as slime names it (`sglang_router_ip`/`sglang_router_port`, set by the rollout manager). What it
returns comes back as this project's sample (samples.from_slime). The wrapped reward gets the slime sample the generate
returned (or, after a generate of this project, the sample converted) and, as slime does, is not called when the
generate already set a reward. At the end of every rollout the HTTP sessions `post` opened in it are closed.

Differences from slime's own rollout: a generate that returns a list of samples (slime's fan-out) is refused; the
`evaluation` keyword is not passed.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import types
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from slime_search.compat.samples import SlimeTrajectory, from_slime, slime_prompt, to_slime
from slime_search.types import Sample

# slime's defaults for the flags of slime's that slime plugins and slime's GenerateState read; the flags given win
# (this project declares the first five; the others it does not declare).
SLIME_DEFAULTS: dict[str, Any] = {
    "rollout_temperature": 1.0,
    "rollout_top_p": 1.0,
    "rollout_max_response_len": None,
    "n_samples_per_prompt": 1,
    "rollout_seed": 42,
    "partial_rollout": False,
    "mask_offpolicy_in_partial_rollout": False,
    "rollout_top_k": -1,
    "rollout_stop": None,
    "rollout_stop_token_ids": None,
    "rollout_skip_special_tokens": False,
    "sglang_server_concurrency": 512,
    "sglang_dp_size": 1,
    "sglang_enable_deterministic_inference": False,
    "use_distributed_post": False,
    "use_rollout_routing_replay": False,
    "apply_chat_template_kwargs": None,
    "ci_test": False,
    "group_rm": False,
}


def is_slime_name(value: Any) -> bool:
    name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
    return isinstance(name, str) and (name == "slime" or name.startswith("slime."))


def uses_slime(function: Callable) -> bool:
    """Whether `function`'s module imported slime or something of it."""
    namespace = getattr(inspect.unwrap(function), "__globals__", None) or {}
    return any(is_slime_name(value) for value in namespace.values())


def slime_args(args: Any) -> argparse.Namespace:
    """`args` as a slime plugin reads them: slime's defaults under the flags given, the router's address derived from
    `engine_url` where the rollout manager did not set it, and the engine count from `engine_urls`."""
    given = dict(vars(args))
    derived: dict[str, Any] = {}
    if given.get("engine_url") and "sglang_router_ip" not in given:
        address = urlsplit(given["engine_url"])
        derived.update(sglang_router_ip=address.hostname, sglang_router_port=address.port)
    if given.get("engine_urls"):
        derived["rollout_num_engines"] = len(given["engine_urls"])
    return argparse.Namespace(**{**SLIME_DEFAULTS, **derived, **given})


def plugin_name(function: Callable) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


class SlimeBoundary:
    """What the wrapped plugins share: slime's args (made once per `args` object) and its generation state."""

    def __init__(self) -> None:
        self._args_of: tuple[Any, argparse.Namespace] | None = None
        self._http_ready = False

    def args(self, args: Any) -> argparse.Namespace:
        if self._args_of is None or self._args_of[0] is not args:
            self._args_of = (args, slime_args(args))
        converted = self._args_of[1]
        if not self._http_ready:
            importlib.import_module("slime.utils.http_utils").init_http_client(converted)
            self._http_ready = True
        return converted

    @staticmethod
    def state(args: argparse.Namespace):
        return importlib.import_module("slime.rollout.sglang_rollout").GenerateState(args)

    def to_slime(self, sample: Sample, args: argparse.Namespace) -> Any:
        sample_class = importlib.import_module("slime.utils.types").Sample
        return to_slime(sample, slime_prompt(sample.prompt, args, self.state(args).tokenizer), sample_class)

    def generate(self, function: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Sample]]:
        name = plugin_name(function)
        sample_class = importlib.import_module("slime.utils.types").Sample

        async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
            converted = self.args(args)
            state = self.state(converted)
            params = {**state.sampling_params, **sampling_params}
            result = await function(converted, self.to_slime(sample, converted), params)
            if isinstance(result, list):
                raise TypeError(f"{name} returned {len(result)} samples: one sample per trajectory is supported")
            if not isinstance(result, sample_class):
                raise TypeError(f"{name} returned a {type(result).__name__}, not a slime Sample")
            return from_slime(result, sample, state.tokenizer, name)

        return generate

    def reward(self, function: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def reward(args, sample: Sample, **kwargs):
            converted = self.args(args)
            view = sample.slime_sample if isinstance(sample, SlimeTrajectory) else None
            view = view if view is not None else self.to_slime(sample, converted)
            if view.reward is not None:  # slime does not score a sample its generate already scored
                return view.reward
            return await function(converted, view, **kwargs)

        return reward

    @staticmethod
    def end_rollout(hook: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        async def end_rollout() -> None:
            try:
                await hook()
            finally:
                close = getattr(importlib.import_module("slime.utils.http_utils"), "close_http_client", None)
                if close is not None:  # this layer's slime; a real slime's client lives as long as its process
                    await close()

        return end_rollout


def adapt_plugins(generate: Callable, reward: Callable, end_rollout: Callable) -> tuple[Callable, Callable, Callable]:
    """The plugins as the rollout calls them: those written against slime wrapped at the boundary, the others as
    they are (the same triple when neither uses slime)."""
    slime_generate, slime_reward = uses_slime(generate), uses_slime(reward)
    if not (slime_generate or slime_reward):
        return generate, reward, end_rollout
    boundary = SlimeBoundary()
    return (
        boundary.generate(generate) if slime_generate else generate,
        boundary.reward(reward) if slime_reward else reward,
        boundary.end_rollout(end_rollout),
    )
