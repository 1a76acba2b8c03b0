"""LoRA adapters served by the CPU engine as SGLang serves them.

An adapter is loaded by name, from tensors (as /load_lora_adapter_from_tensors sends them) or from a PEFT folder. It
is unloaded by name. A /generate request asks for it by its `lora_path`. A request that names none is answered by
the base model.

The CPU engine answers a request that names an adapter with a copy of its model that has the adapter folded in
(W + lora_alpha / r x B A, PEFT's LoRA). The copy is made at load and made again when the base weights change. It
costs one model's memory per loaded adapter, which at the CPU engine's sizes is small.
"""

# No `from __future__ import annotations`: FastAPI resolves the handlers' annotations at run time.
import copy
import json
import re
from pathlib import Path

import torch

PEFT_KEY = re.compile(r"base_model\.model\.(.+)\.lora_(A|B)\.weight")


def never_loaded(name: str, loaded) -> str:
    """SGLang 0.5.23's message for a request naming an adapter it does not hold."""
    return f"Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: {loaded}."


def adapter_pairs(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT's tensors as {HF module path: (A, B)}; ValueError for a name that is not a LoRA weight."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        match = PEFT_KEY.fullmatch(key.replace(".default.", "."))
        if match is None:
            raise ValueError(f"{key} is not a PEFT LoRA weight (base_model.model.<module>.lora_A|B.weight)")
        halves.setdefault(match[1], {})[match[2]] = tensor
    missing = sorted(path for path, pair in halves.items() if set(pair) != {"A", "B"})
    if missing:
        raise ValueError(f"adapters without both lora_A and lora_B: {missing[:3]}")
    return {path: (pair["A"], pair["B"]) for path, pair in halves.items()}


def scale_of(config: dict) -> float:
    if config.get("use_rslora") or config.get("use_dora"):
        raise ValueError("the CPU engine serves plain LoRA adapters (no rsLoRA, no DoRA)")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank <= 0 or not isinstance(alpha, int | float):
        raise ValueError(f"adapter_config needs r (a positive int) and lora_alpha, got r={rank!r} lora_alpha={alpha!r}")
    return float(alpha) / rank


@torch.no_grad()
def folded(model: torch.nn.Module, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float):
    """A copy of `model` with each adapter folded into the weight of its module; ValueError when one does not fit."""
    out = copy.deepcopy(model)
    for path, (a, b) in pairs.items():
        try:
            module = out.get_submodule(path)
        except AttributeError:
            raise ValueError(f"the model has no module {path} for an adapter") from None
        weight = module.weight
        if a.shape[1] != weight.shape[1] or b.shape[0] != weight.shape[0] or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"{path}: A {list(a.shape)} and B {list(b.shape)} do not fit its weight {list(weight.shape)}"
            )
        weight += (scale * (b.float() @ a.float())).to(device=weight.device, dtype=weight.dtype)
    return out


class CpuAdapters:
    """The adapters an engine holds, each with its folded copy of the base model."""

    def __init__(self):
        self._adapters: dict[str, tuple[dict, float]] = {}  # name -> (its (A, B) pairs, its scale)
        self._models: dict[str, torch.nn.Module] = {}

    def names(self):
        return self._adapters.keys()

    def load(self, name: str, state: dict[str, torch.Tensor], config: dict, base: torch.nn.Module) -> None:
        if name in self._adapters:
            raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
        pairs = {path: (a.detach().clone(), b.detach().clone()) for path, (a, b) in adapter_pairs(state).items()}
        scale = scale_of(config)
        self._models[name] = folded(base, pairs, scale)  # checks every pair before the adapter is held
        self._adapters[name] = (pairs, scale)

    def unload(self, name: str) -> None:
        if name not in self._adapters:
            raise ValueError(f"LoRA with name {name} does not exist. Loaded LoRAs: {self.names()}")
        del self._adapters[name], self._models[name]

    def model(self, name: str) -> torch.nn.Module:
        if name not in self._models:
            raise ValueError(never_loaded(name, self.names()))
        return self._models[name]

    def refold(self, base: torch.nn.Module) -> None:
        """The base weights changed: every adapter is folded again into the new ones."""
        self._models = {name: folded(base, pairs, scale) for name, (pairs, scale) in self._adapters.items()}


def read_folder(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """A PEFT adapter folder's tensors and adapter_config.json."""
    from safetensors.torch import load_file

    folder = Path(path)
    if not (folder / "adapter_config.json").is_file() or not (folder / "adapter_model.safetensors").is_file():
        raise ValueError(f"{path} is not a PEFT adapter folder (adapter_config.json, adapter_model.safetensors)")
    return load_file(str(folder / "adapter_model.safetensors")), json.loads(
        (folder / "adapter_config.json").read_text()
    )


def add_lora_routes(app, engine, batcher, read_json) -> None:
    """SGLang's LoRA endpoints and /update_weight_version, each run on the engine's worker between batches."""
    from fastapi import Request

    from slime_search.engines.validation import BadRequest, string

    def lora_answer(name: str, error: Exception | None):
        from fastapi.responses import JSONResponse

        if error is not None:
            return JSONResponse({"success": False, "error_message": str(error)}, status_code=400)
        return JSONResponse(
            {"success": True, "error_message": "", "loaded_adapters": {n: n for n in engine.adapters.names()}}
        )

    async def load(name: str, state, config) -> Exception | None:
        try:
            await batcher.run_in_worker(engine.adapters.load, name, state, config, engine.model)
        except ValueError as err:
            return err
        return None

    @app.api_route("/load_lora_adapter_from_tensors", methods=["POST"])
    async def load_from_tensors(request: Request):
        from slime_search.engines.weight_wire import deserialize_named_tensors

        body = await read_json(request)
        name, config, entries = string(body, "lora_name"), body.get("config_dict"), body.get("serialized_named_tensors")
        if not isinstance(config, dict):
            raise BadRequest("'config_dict' must be the adapter's adapter_config.json, a JSON object")
        if not isinstance(entries, list) or len(entries) != 1 or not isinstance(entries[0], str):
            raise BadRequest("the CPU engine is one rank: send one serialized_named_tensors entry (a string)")
        state = deserialize_named_tensors(entries[0], mapping=True)
        return lora_answer(name, await load(name, state, config))

    @app.api_route("/load_lora_adapter", methods=["POST"])
    async def load_from_folder(request: Request):
        body = await read_json(request)
        name = string(body, "lora_name")
        try:
            state, config = read_folder(string(body, "lora_path"))
        except ValueError as err:
            return lora_answer(name, err)
        return lora_answer(name, await load(name, state, config))

    @app.api_route("/unload_lora_adapter", methods=["POST"])
    async def unload(request: Request):
        name = string(await read_json(request), "lora_name")
        try:
            await batcher.run_in_worker(engine.adapters.unload, name)
        except ValueError as err:
            return lora_answer(name, err)
        return lora_answer(name, None)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        from fastapi.responses import JSONResponse

        body = await read_json(request)
        version = string(body, "new_version")
        if body.get("abort_all_requests", True):
            batcher.abort_all()

        def update() -> None:
            engine.weight_version = version

        await batcher.run_in_worker(update)
        return JSONResponse(
            {"success": True, "message": f"Weight version updated to {version}", "new_version": version}
        )
