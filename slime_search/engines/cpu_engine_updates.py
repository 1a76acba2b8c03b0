"""The CPU engine server's weight-update endpoints, as SGLang answers them.

- the weight-update session that tensor and distributed updates must sit in;
- tensor handles over shared memory (/update_weights_from_tensor);
- broadcast over a gloo group the trainer hosts (/init_weights_update_group, /update_weights_from_distributed,
  /destroy_weights_update_group).

Each update runs on the engine's worker, between batches.
"""

# No `from __future__ import annotations`: FastAPI resolves the handlers' annotations at run time.
import asyncio
from typing import Any

from slime_search.engines.validation import BadRequest, optional_version, string, weight_bucket, weight_group_join


class UpdateSession:
    """SGLang's weight-update session: tensor and distributed updates are refused outside begin ... end."""

    def __init__(self):
        self.open = False

    def begin(self) -> dict:
        if self.open:
            return {
                "success": False,
                "message": "a weight-update session is already open; call end_weight_update() first",
            }
        self.open = True
        return {"success": True, "message": "Success"}

    def end(self) -> dict:
        if not self.open:
            return {"success": False, "message": "no weight-update session is open; call begin_weight_update() first"}
        self.open = False
        return {"success": True, "message": "Success"}

    def refusal(self, endpoint: str) -> dict | None:
        if self.open:
            return None
        return {
            "success": False,
            "message": f"{endpoint} must run between begin_weight_update() and end_weight_update()",
        }


def answer(content: dict):
    """SGLang's control answers: {"success", "message", ...}, 200 on success and 400 otherwise."""
    from fastapi.responses import JSONResponse

    return JSONResponse(content, status_code=200 if content["success"] else 400)


def failure(err: Exception) -> dict:
    return {"success": False, "message": f"{type(err).__name__}: {err}"}


def add_tensor_update_route(app, engine, batcher, session: UpdateSession, read_json) -> None:
    """SGLang's tensor-handle weight sync: one serialized list of (name, tensor) over shared memory."""
    from fastapi import Request

    @app.post("/update_weights_from_tensor")
    async def update_from_tensor(request: Request):
        from slime_search.engines.weight_wire import deserialize_named_tensors

        body = await read_json(request)
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or len(entries) != 1 or not isinstance(entries[0], str):
            raise BadRequest("the CPU engine is one rank: send one serialized_named_tensors entry (a string)")
        if body.get("load_format") not in (None, "direct"):
            raise BadRequest(f"load_format {body.get('load_format')!r} is not supported (use null)")
        refused = session.refusal("update_weights_from_tensor")
        if refused:
            return answer(refused)
        version = optional_version(body)

        def load():
            return engine.load_named_tensors(deserialize_named_tensors(entries[0]), version)

        try:
            await batcher.run_in_worker(load)
        except (ValueError, RuntimeError, TypeError) as err:  # a payload that does not map onto the model
            return answer(failure(err))
        return answer({"success": True, "message": "Success"})


def add_weight_update_group_routes(app, engine, batcher, session: UpdateSession, read_json) -> None:
    """SGLang's broadcast weight sync over gloo: join the trainer's group, receive buckets, leave."""
    from fastapi import Request

    from slime_search.engines.weight_wire import DEFAULT_GROUP_NAME, join_weight_update_group, receive_tensors

    groups: dict[str, Any] = {}

    @app.post("/init_weights_update_group")
    async def init_group(request: Request):
        join = weight_group_join(await read_json(request), DEFAULT_GROUP_NAME)
        name, backend, address, port = join["name"], join["backend"], join["address"], join["port"]
        rank, world_size = join["rank"], join["world_size"]
        if backend != "gloo":
            raise BadRequest(f"the CPU engine joins weight-update groups over gloo, not {backend!r}")
        if name in groups:
            raise BadRequest(f"already in weight-update group {name!r}")
        try:
            groups[name] = await asyncio.to_thread(
                join_weight_update_group, "gloo", address, port, rank, world_size, name, 600.0
            )
        except (RuntimeError, ValueError) as err:
            return answer(failure(err))
        return answer({"success": True, "message": f"joined {name} as rank {rank} of {world_size}"})

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(request: Request):
        body = await read_json(request)
        name = string(body, "group_name", DEFAULT_GROUP_NAME)
        if name not in groups:
            raise BadRequest(f"not in weight-update group {name!r}: POST /init_weights_update_group first")
        names, dtypes, shapes = weight_bucket(body)
        refused = session.refusal("update_weights_from_distributed")
        if refused:  # as SGLang: refused before any tensor is received
            return answer(refused)
        version = optional_version(body)

        def receive_and_load():
            tensors = receive_tensors(groups[name], names, dtypes, shapes)
            return engine.load_named_tensors(tensors, version)

        try:
            await batcher.run_in_worker(receive_and_load)
        except (RuntimeError, ValueError) as err:
            return answer(failure(err))
        return answer({"success": True, "message": "Succeeded to update parameter online."})

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request):
        import torch.distributed as dist

        name = string(await read_json(request), "group_name", DEFAULT_GROUP_NAME)
        if name not in groups:
            return answer({"success": False, "message": f"not in weight-update group {name!r}"})
        dist.destroy_process_group(groups.pop(name))
        return answer({"success": True, "message": f"left {name}"})
