"""slime.utils.misc: the helpers of slime's misc module that plugins and the sample type use."""

from __future__ import annotations

import base64
import importlib
from collections.abc import Iterable
from typing import Any

import torch


def load_function(path: str):
    """The attribute `path` names, e.g. "module.submodule.function" (slime's loader: no checks of its own)."""
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


class SingletonMeta(type):
    """One instance per class, made by the first call; later calls return it whatever their arguments (slime's
    GenerateState relies on this). `_instances` is slime's name for the registry."""

    _instances: dict[type, Any] = {}

    def __call__(cls, *args, **kwargs):
        if cls not in SingletonMeta._instances:
            SingletonMeta._instances[cls] = super().__call__(*args, **kwargs)
        return SingletonMeta._instances[cls]


def decode_int32_meta_array(meta_info: dict[str, Any], keys: str | Iterable[str]) -> torch.Tensor | None:
    """The first of `keys` present in SGLang's meta_info as a flat CPU int32 tensor (None when none is, or its value
    is None). SGLang sends such arrays as base64 text, raw bytes, tensors or lists."""
    candidates = (keys,) if isinstance(keys, str) else tuple(keys)
    key = next((k for k in candidates if k in meta_info), None)
    value = None if key is None else meta_info[key]
    if value is None:
        return None
    if isinstance(value, str):
        value = base64.b64decode(value.encode("ascii"))
    if isinstance(value, bytes | bytearray | memoryview):
        return torch.frombuffer(bytearray(value), dtype=torch.int32)
    if torch.is_tensor(value):
        return value.detach().to(device="cpu", dtype=torch.int32).reshape(-1)
    if hasattr(value, "flags") and not value.flags.writeable:  # a read-only numpy view
        value = value.copy()
    return torch.as_tensor(value, dtype=torch.int32).reshape(-1)
