"""Load extension points (generate, reward, filters) by dotted path, as slime's `--custom-*-path` flags do.

The rollout plugins keep slime's signatures: `async def generate(args, sample, sampling_params) -> Sample` and
`async def reward_func(args, sample, **kw) -> float | dict`. A generate plugin's module may also define these hooks:

- `async def close_resources()`: awaited at the end of every rollout, in the rollout's event loop, so the plugin can
  close what it opened for that rollout (connection pools, clients).
- `def check_args(args) -> None`: called once when the command line is parsed, before anything starts; it raises
  ValueError with a message naming the flag at fault, which the CLI turns into a usage error. The engines' addresses
  are not known yet then (`args` has none).
- `def preflight(args) -> None`: called by the CLI after parsing, before Ray starts and the models load; it checks
  that the services the plugin needs answer (a retriever, an API key) and raises RuntimeError naming the address and
  what failed.

Plugins written against slime itself (importing `slime.utils.types.Sample`, `GenerateState`, `http_utils.post`) load
too. Without slime installed, `slime` is served by slime_search.compat; a real slime is never shadowed. Such plugins
get slime's samples at the boundary (slime_search.compat.boundary).
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from slime_search.compat import finder

END_OF_ROLLOUT_HOOK = "close_resources"
CHECK_ARGS_HOOK = "check_args"
PREFLIGHT_HOOK = "preflight"


class PluginLoadError(ImportError):
    """A dotted path did not resolve to a callable; the message names the part that failed."""


def load_function(path: str) -> Callable[..., Any]:
    """Return the callable named by `path`, e.g. "slime_search.search_r1.generate.generate"."""
    if not isinstance(path, str) or "." not in path.strip(".") or path.startswith(".") or path.endswith("."):
        raise PluginLoadError(f"expected a dotted path like 'package.module.function', got {path!r}")
    module_name, _, attr = path.rpartition(".")
    finder.install()  # a plugin written against slime finds slime's plugin API even where slime is not installed
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        # Distinguish "the plugin module is missing" from "the plugin imports something missing".
        if err.name and module_name.startswith(err.name):
            raise PluginLoadError(f"cannot load {path!r}: module {module_name!r} not found") from err
        raise PluginLoadError(
            f"cannot load {path!r}: importing module {module_name!r} failed because {err.name!r} is missing"
        ) from err
    try:
        obj = getattr(module, attr)
    except AttributeError as err:
        raise PluginLoadError(f"cannot load {path!r}: module {module_name!r} has no attribute {attr!r}") from err
    if not callable(obj):
        raise PluginLoadError(f"cannot load {path!r}: {attr!r} is a {type(obj).__name__}, not a callable")
    return obj


def module_hook(generate_path: str, name: str) -> Callable[..., Any] | None:
    """The hook `name` of the generate plugin's module, or None when it defines none; loading the generate plugin
    itself first, so a bad path is reported as such."""
    load_function(generate_path)
    module_name = generate_path.rpartition(".")[0]
    hook = getattr(importlib.import_module(module_name), name, None)
    if hook is not None and not callable(hook):
        raise PluginLoadError(f"{module_name}.{name} must be a function")
    return hook


def check_plugin_args(generate_path: str, args: Any) -> None:
    """The generate plugin module's `check_args(args)`, if it defines one: ValueError naming the flag at fault."""
    hook = module_hook(generate_path, CHECK_ARGS_HOOK)
    if hook is not None:
        hook(args)


def run_preflight(generate_path: str, args: Any) -> None:
    """The generate plugin module's `preflight(args)`, if it defines one: RuntimeError when a service it needs fails."""
    hook = module_hook(generate_path, PREFLIGHT_HOOK)
    if hook is not None:
        hook(args)


async def _nothing_to_close() -> None:
    return None


@dataclass(frozen=True)
class Plugins:
    """The rollout's plugins, loaded once: generate, reward, and the generate module's end-of-rollout hook."""

    generate: Callable[..., Awaitable[Any]]
    reward: Callable[..., Awaitable[Any]]
    end_rollout: Callable[[], Awaitable[None]] = _nothing_to_close

    @classmethod
    def load(cls, generate_path: str, reward_path: str) -> Plugins:
        generate, reward = load_function(generate_path), load_function(reward_path)
        module_name = generate_path.rpartition(".")[0]
        hook = getattr(importlib.import_module(module_name), END_OF_ROLLOUT_HOOK, None)
        if hook is not None and not callable(hook):
            raise PluginLoadError(f"{module_name}.{END_OF_ROLLOUT_HOOK} must be an async function")
        from slime_search.compat.boundary import adapt_plugins

        return cls(*adapt_plugins(generate, reward, hook or _nothing_to_close))
