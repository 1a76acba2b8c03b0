"""Load extension points (generate, reward, filters) by dotted path, as slime's `--custom-*-path` flags do."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class PluginLoadError(ImportError):
    """A dotted path did not resolve to a callable; the message names the part that failed."""


def load_function(path: str) -> Callable[..., Any]:
    """Return the callable named by `path`, e.g. "slime_search.search_r1.generate.generate"."""
    if not isinstance(path, str) or "." not in path.strip(".") or path.startswith(".") or path.endswith("."):
        raise PluginLoadError(f"expected a dotted path like 'package.module.function', got {path!r}")
    module_name, _, attr = path.rpartition(".")
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
