"""SGLang's native HTTP API, served on CPU by a transformers model (the rollout engine of CPU runs and tests).

    python -m slime_search.engines.cpu_engine_server --model-path CKPT [--port 30000] [--max-batch-size 32]

It answers as the pinned SGLang (SGLANG_VERSION, reported by /server_info) does, field for field. So the client code
paths that run against it are the ones that run against SGLang; tests hold both to the same assertions. Its endpoints:
POST /generate (with return_logprob, the sampled tokens' log-probs and, from logprob_start_len on, the input tokens' as
SGLang gives them); GET /health, /health_generate (empty bodies); GET /model_info (the served weight version),
/server_info; POST /update_weights_from_disk; the weight-update session (/begin_weight_update, /end_weight_update) that
tensor and distributed updates must sit in; broadcast weight sync (/init_weights_update_group,
/update_weights_from_distributed, /destroy_weights_update_group) over gloo; /update_weights_from_tensor with
shared-memory handles (those in cpu_engine_updates.py); LoRA adapters loaded and unloaded by name and a /generate's
`lora_path`, and /update_weight_version (cpu_engine_lora.py); /release_memory_occupation and /resume_memory_occupation
(JSON null); /flush_cache (plain text; with ?timeout= it waits for the engine to be idle and answers 400 if it never
is); /abort_request (empty body). Concurrent /generate requests are collected for a few milliseconds and run as one
batch (shared prefill and decode passes over a KV cache). Weight updates run on the same worker, between batches, so no
generation ever mixes two weight versions. Where SGLang would crash (out-of-range token ids, unknown memory tags, a
memory release while a request is running or waiting, after which SGLang's whole process exits), the CPU engine answers
400 instead.
"""

# No `from __future__ import annotations`: FastAPI resolves the handlers' annotations at run time.
import argparse
import asyncio
import logging
import sys
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from slime_search.engines.cpu_engine_updates import (
    UpdateSession,
    add_tensor_update_route,
    add_weight_update_group_routes,
    answer,
    failure,
)
from slime_search.engines.sampling import SamplingParams
from slime_search.engines.validation import (
    BadRequest,
    SchemaViolation,
    logprob_start,
    optional_version,
    parse_json_object,
    string,
)
from slime_search.utils.batching import WorkerBatcher, resolve

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"  # the SGLang release whose API this server answers (constraints-gpu.txt pins it)
# The sampling parameters SGLang 0.5.23 accepts (api/v1/api_types.py); any other key is refused as SGLang refuses it.
SGLANG_SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)  # fmt: skip
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the "
    "operation will not be performed.)\n"
)
# SGLang's other /flush_cache answers (400): busy without a timeout, or not idle within it.
FLUSH_FAILED = "Flush cache failed.\n"
FLUSH_TIMED_OUT = "Timed out waiting for idle state."
NOT_IDLE = "release_memory_occupation should be called only when server is idle."


@dataclass(frozen=True)
class EngineServerConfig:
    max_batch_size: int = 32
    max_wait_ms: float = 5.0


def check_sampling_keys(params: Any) -> None:
    if params is None:
        return
    if not isinstance(params, dict):
        raise SchemaViolation("invalid type: sampling_params must be a map")
    for key in params:
        if key not in SGLANG_SAMPLING_KEYS:
            expected = ", ".join(f"`{k}`" for k in SGLANG_SAMPLING_KEYS)
            raise SchemaViolation(f"unknown field `{key}`, expected one of {expected}")
    unsupported = sorted(set(params) - set(SamplingParams.__dataclass_fields__))
    if unsupported:
        raise BadRequest(f"sampling parameters the CPU engine does not implement: {unsupported}")


def parse_generate(body: Any, tokenizer, vocab_size: int, max_positions: int, adapters=None):
    """Validate a /generate body into (GenerationRequest, return_logprob); `adapters`: the names of the LoRA adapters
    loaded, one of which a `lora_path` must name."""
    from slime_search.engines.cpu_engine import GenerationRequest

    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    if body.get("stream"):
        raise BadRequest("streaming is not supported by the CPU engine")
    if ("input_ids" in body) == ("text" in body):
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    check_sampling_keys(body.get("sampling_params"))
    if "text" in body:
        if not isinstance(body["text"], str):
            raise BadRequest("'text' must be a string (batched prompts: send one request each)")
        try:
            input_ids = tokenizer.encode(body["text"], add_special_tokens=False)
        except (TypeError, ValueError, UnicodeError) as err:  # e.g. a lone surrogate the tokenizer cannot encode
            raise BadRequest(f"'text' cannot be tokenised: {err}") from err
    else:
        input_ids = body["input_ids"]
        if not isinstance(input_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in input_ids
        ):
            raise BadRequest("'input_ids' must be a list of integers (batched prompts: send one request each)")
    if not input_ids:
        raise BadRequest("input_ids cannot be empty.")
    bad = [t for t in input_ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"token ids out of range [0, {vocab_size}): {bad[:5]}")
    try:
        params = SamplingParams.from_request(body.get("sampling_params"))
    except (TypeError, ValueError) as err:
        raise BadRequest(f"bad sampling_params: {err}") from err
    if len(input_ids) + params.max_new_tokens > max_positions:
        raise BadRequest(
            f"prompt ({len(input_ids)}) + max_new_tokens ({params.max_new_tokens}) exceeds the context of {max_positions}"
        )
    rid = str(body.get("rid") or uuid.uuid4().hex)
    return_logprob = bool(body.get("return_logprob", False))
    start = logprob_start(body.get("logprob_start_len"), len(input_ids)) if return_logprob else None
    lora = lora_of(body, adapters)
    return GenerationRequest(input_ids, params, rid, logprob_start=start, lora=lora), return_logprob


def lora_of(body: dict, adapters) -> str | None:
    """The adapter a /generate names (SGLang's `lora_path`: a loaded adapter's name), or None."""
    from slime_search.engines.cpu_engine_lora import never_loaded

    name = body.get("lora_path")
    if name is None:
        return None
    if not isinstance(name, str):
        raise BadRequest("'lora_path' must be the name of a loaded adapter (batched prompts: send one request each)")
    if adapters is None or name not in adapters:
        raise BadRequest(never_loaded(name, adapters if adapters is not None else {}.keys()))
    return name


def format_result(request, result, return_logprob: bool) -> dict:
    completion = len(result.output_ids)
    meta = {
        "id": request.rid,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "weight_version": result.weight_version,
        "num_retractions": result.num_retractions,
        "completion_tokens": completion,
        "cached_tokens": 0,
        "weight_versions": result.weight_versions(),
    }
    if return_logprob:  # as SGLang: the input log-probs are [] unless a logprob_start_len asked for them
        asked = request.input_ids[request.logprob_start :] if request.logprob_start is not None else []
        meta["input_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(result.input_log_probs, asked, strict=True)]
        meta["output_token_logprobs"] = [
            [lp, tok, None] for lp, tok in zip(result.log_probs, result.output_ids, strict=True)
        ]
    return {"text": result.text, "output_ids": result.output_ids, "meta_info": meta}


class PauseGate:
    """SGLang's /pause_generation and /continue_generation: while paused, no request starts decoding (new ones wait
    at the door, retracted ones for their turn again)."""

    def __init__(self, engine):
        self.engine = engine
        self.open = asyncio.Event()
        self.open.set()

    @property
    def paused(self) -> bool:
        return not self.open.is_set()

    def pause(self, mode: str) -> None:
        self.engine.pause(mode)
        self.open.clear()

    def resume(self) -> None:
        self.engine.resume()
        self.open.set()

    async def wait(self) -> None:
        await self.open.wait()


class GenerationBatcher(WorkerBatcher):
    """Generation requests batched onto the thread that owns the engine. A request a pause retracted goes back into
    the queue, with its output so far, once generation continues; its caller gets one answer for all of it. It knows
    the requests not yet answered (running, queued or held by a pause): SGLang's idleness."""

    def __init__(self, engine, config: EngineServerConfig, gate: PauseGate):
        super().__init__(config.max_batch_size, config.max_wait_ms / 1000.0, "engine")
        self.engine = engine
        self.gate = gate
        self._continuations: set[asyncio.Task] = set()
        self._unanswered: dict[int, str] = {}  # id of a submitted request -> its rid
        self._idle = asyncio.Event()
        self._idle.set()

    async def submit(self, item):
        key = id(item)
        self._unanswered[key] = item.rid
        self._idle.clear()
        try:
            return await super().submit(item)
        finally:
            del self._unanswered[key]
            if not self._unanswered:
                self._idle.set()

    def idle(self, ignore_waiting: bool = False) -> bool:
        """SGLang's is_fully_idle: no request running or waiting; `ignore_waiting`: those a pause holds do not count."""
        held = len(self._continuations) if ignore_waiting else 0
        return len(self._unanswered) <= held

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def abort_all(self) -> None:
        """SGLang's abort_all: the running requests, and those waiting, end with an abort."""
        for rid in list(self._unanswered.values()):
            self.engine.abort(rid)
        self.engine.abort(None)

    async def process(self, batch) -> None:
        try:
            results = await self.run_in_worker(self.engine.generate, [request for request, _ in batch])
        except Exception as err:  # noqa: BLE001 - the batch's requests fail; the server carries on
            logger.exception("generation batch of %d failed", len(batch))
            for _, future in batch:
                resolve(future, error=err)
            return
        for (request, future), result in zip(batch, results, strict=True):
            if result.retracted:
                task = asyncio.get_running_loop().create_task(self._continue(request, result, future))
                self._continuations.add(task)
                task.add_done_callback(self._continuations.discard)
            else:
                resolve(future, result)

    async def _continue(self, request, partial, future) -> None:
        from dataclasses import replace

        await self.gate.wait()
        await self.queue.put((replace(request, prior=partial), future))


def create_app(engine, config: EngineServerConfig):
    from fastapi import FastAPI, Query, Request, Response
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    from slime_search.engines.cpu_engine import EngineNotReady
    from slime_search.engines.cpu_engine_lora import add_lora_routes

    gate = PauseGate(engine)
    batcher = GenerationBatcher(engine, config, gate)
    session = UpdateSession()
    vocab_size = int(engine.model.config.vocab_size)
    max_positions = int(getattr(engine.model.config, "max_position_embeddings", 1 << 30))

    @asynccontextmanager
    async def lifespan(app):
        batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="slime-search CPU engine", lifespan=lifespan)

    async def read_json(request: Request) -> dict:
        return parse_json_object(await request.body(), request.url.path)

    @app.exception_handler(EngineNotReady)
    async def not_ready(request: Request, err: EngineNotReady):
        return JSONResponse({"error": {"message": str(err)}}, status_code=503)

    @app.exception_handler(RequestValidationError)
    async def invalid_parameter(request: Request, err: RequestValidationError):
        # SGLang's answer to a parameter FastAPI refuses (a negative /flush_cache timeout): 400, not FastAPI's 422
        errors = str(err.errors())
        message = f"{err} {errors}" if errors and errors != str(err) else str(err)
        body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
        return JSONResponse(body, status_code=400)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, err: BadRequest):
        body = str(err) if isinstance(err, SchemaViolation) else {"message": str(err)}
        return JSONResponse({"error": body}, status_code=400)

    @app.post("/generate")
    async def generate(request: Request):
        body = await read_json(request)
        gen_request, return_logprob = parse_generate(
            body, engine.tokenizer, vocab_size, max_positions, engine.adapters.names()
        )
        await gate.wait()
        result = await batcher.submit(gen_request)
        return JSONResponse(format_result(gen_request, result, return_logprob))

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = await read_json(request)
        mode = body.get("mode", "abort")
        if not isinstance(mode, str):
            raise BadRequest("'mode' must be a string")
        try:
            gate.pause(mode)
        except ValueError as err:
            raise BadRequest(str(err)) from err
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        await read_json(request)
        gate.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        await gate.wait()
        probe, _ = parse_generate(
            {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
            engine.tokenizer,
            vocab_size,
            max_positions,
        )
        await batcher.submit(probe)
        return Response(status_code=200)

    def model_info():
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.model_path,
            "is_generation": True,
            "weight_version": engine.weight_version,
        }

    def server_info():
        state = {
            "batches": batcher.batches,
            "requests": batcher.units,
            "queue_depth": batcher.queue_depth,
            "released_memory": sorted(engine.released),
            "weights_not_updated_since_resume": len(engine.stale),
        }
        # LoRA is always on (any rank, every projection): SGLang reports its --enable-lora and --max-lora-rank
        lora = {"enable_lora": True, "max_lora_rank": None}
        return {"version": SGLANG_VERSION, "model_path": engine.model_path, **lora, "internal_states": [state]}

    for path, info in (("/model_info", model_info), ("/get_model_info", model_info)):
        app.get(path)(info)
    for path, info in (("/server_info", server_info), ("/get_server_info", server_info)):
        app.get(path)(info)

    @app.post("/update_weights_from_disk")
    async def update_weights(request: Request):
        body = await read_json(request)
        path = string(body, "model_path")
        version = optional_version(body)
        try:
            await batcher.run_in_worker(engine.update_weights_from_disk, path, version)
        except Exception as err:  # noqa: BLE001 - any checkpoint that cannot be loaded (missing, refused by
            # weights_only, corrupt, another architecture) is the caller's: the engine keeps its weights
            return answer({**failure(err), "num_paused_requests": 0})
        message = "Succeeded to update model weights." + (f" Weight version updated to {version}." if version else "")
        return answer({"success": True, "message": message, "num_paused_requests": 0})

    @app.post("/begin_weight_update")
    async def begin_weight_update():
        return answer(session.begin())

    @app.post("/end_weight_update")
    async def end_weight_update():
        return answer(session.end())

    @app.post("/release_memory_occupation")
    async def release_memory(request: Request):
        tags = memory_tags(await read_json(request))
        if not batcher.idle(ignore_waiting=gate.paused):
            raise BadRequest(NOT_IDLE)
        await batcher.run_in_worker(engine.release_memory, tags)
        return JSONResponse(None)

    @app.post("/resume_memory_occupation")
    async def resume_memory(request: Request):
        await batcher.run_in_worker(engine.resume_memory, memory_tags(await read_json(request)))
        return JSONResponse(None)

    one_flush_at_a_time = asyncio.Lock()  # SGLang queues concurrent flushes, each answered in turn

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = Query(0.0, ge=0.0)):
        # The KV cache lives only for the duration of a batch, so there is no cross-request cache to drop; what is
        # SGLang's is when a flush may happen (idle only) and how long one waits for it (`timeout` seconds).
        async with one_flush_at_a_time:
            if timeout <= 0 or batcher.idle():
                flushed = batcher.idle(ignore_waiting=gate.paused)
                return Response(FLUSHED if flushed else FLUSH_FAILED, status_code=200 if flushed else 400)
            try:
                await asyncio.wait_for(batcher.wait_idle(), timeout)
            except TimeoutError:
                return Response(FLUSH_TIMED_OUT, status_code=400)
            return Response(FLUSHED)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await read_json(request)
        rid = body.get("rid")
        abort_all = body.get("abort_all", False)
        if (rid is not None and not isinstance(rid, str)) or not isinstance(abort_all, bool):
            raise BadRequest("'rid' must be a string and 'abort_all' a boolean")
        if abort_all:
            batcher.abort_all()
        elif rid:
            engine.abort(rid)
        return Response(status_code=200)

    add_tensor_update_route(app, engine, batcher, session, read_json)
    add_weight_update_group_routes(app, engine, batcher, session, read_json)
    add_lora_routes(app, engine, batcher, read_json)
    return app


def memory_tags(body: dict) -> list[str] | None:
    from slime_search.engines.cpu_engine import CpuEngine

    tags = body.get("tags")
    if tags is not None and (not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)):
        raise BadRequest("'tags' must be a list of strings or null")
    try:
        CpuEngine._check_tags(tags)
    except ValueError as err:
        raise BadRequest(str(err)) from err
    return tags


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True, help="HF checkpoint folder (config, safetensors, tokenizer)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed at start)")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weight-version", default="default", help="the version served before any update (SGLang's)")
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu, or cuda beside a GPU actor")
    faults = parser.add_argument_group("injected faults (for measuring what a training run does about them)")
    faults.add_argument(
        "--decode-delay-ms", type=float, default=0.0, help="sleep this long in every decode step (a slow engine)"
    )
    faults.add_argument(
        "--freeze-weights-after",
        type=int,
        default=None,
        help="acknowledge weight updates from disk to a later version without loading them (a stale engine)",
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = parse_args(argv)
    import torch
    import uvicorn

    from slime_search.engines.cpu_engine import CpuEngine, InjectedFaults
    from slime_search.utils.net import listen_socket

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    try:
        faults = InjectedFaults(args.decode_delay_ms / 1000.0, args.freeze_weights_after)
        engine = CpuEngine(
            args.model_path, seed=args.seed, weight_version=args.weight_version, faults=faults, device=args.device
        )
    except OSError as err:
        print(f"error: cannot load a model from {args.model_path}: {err}", file=sys.stderr)
        return 2
    app = create_app(engine, EngineServerConfig(args.max_batch_size, args.max_wait_ms))
    sock = listen_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    print(f"serving on http://{host}:{port}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", backlog=4096))
    asyncio.run(server.serve(sockets=[sock]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
