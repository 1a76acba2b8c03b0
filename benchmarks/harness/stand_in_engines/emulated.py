"""An engine that answers SGLang's /generate with real Search-R1 turns at the pace of an SGLang engine on one GPU.

    python -m benchmarks.harness.stand_in_engines.emulated --tokenizer DIR \
        --trajectories ../shared/data/trajectories/search_r1_3b_base_nq.jsonl --port 0 [--time-scale 0.25]

What it says comes from recorded trajectories (benchmarks.harness.stand_in_engines.replay): the turn of the question in
the prompt, cut where SGLang would stop. Its timing comes from a model of continuous batching. Every running request
gains one token per decode step. A step takes the inter-token latency the modelled GPU has at that many running requests
(`GpuTiming`, interpolated). It adds the prefill of the tokens that joined; a trajectory's earlier turns stay in the
prefix cache. At most `max_running` requests decode at once (the KV cache's bound); the others wait. Every emulated
duration is multiplied by --time-scale, so a run can go faster than real time.

The emulated GPU keeps its own clock. SGLang's scheduler runs in a process of its own, beside the HTTP front end, so
its GPU does not wait while requests are parsed; here one event loop does both, so a decode step that starts late
because the loop was busy is made up by the steps after it (they run back to back until the clock is caught up). A
request joins the batch only at a step that begins after it arrived, so making up never decodes a request early. A
lag beyond LAG_MADE_UP_S is not made up: it is counted as late, the emulator's own cost, as is a lag a pause cuts off.

Weight sync is emulated too. The endpoint /update_weights_from_disk (and the distributed update) takes the modelled
push time and then serves the new version. The endpoint /pause_generation (retract) stops decoding and keeps every
request's tokens. The endpoint /continue_generation re-prefills them and goes on. Each token records the version that
generated it (SGLang's `weight_versions` spans). It serves the asynchronous-training benchmark
(benchmarks.perf.rollout_overlap).
"""

# No `from __future__ import annotations`: FastAPI resolves the handlers' annotations at run time.
import argparse
import asyncio
import bisect
import json
import re
import sys
import time
from dataclasses import dataclass, field

from benchmarks.harness.stand_in_engines.replay import OBSERVATION_MARKERS, script_from_trajectories, turn_response
from slime_search.search_r1.prompt import normalize_question

QUESTION = re.compile(r"Question: (.*?\?)\n")

PLANS_KEPT = 20_000  # answers worked out and kept for the question's other samples (a run has a few thousand contexts)
SOON_AFTER_UPDATE_S = 1.0  # an idle gap that began this soon after a weight update waits for the next batch
# emulated seconds of lag the GPU's clock makes up (bursts of requests parsed on the one event loop take a
# fraction of a second); a longer lag means the emulator cannot keep up, and is counted as late
LAG_MADE_UP_S = 1.0

# Qwen2.5-3B on one H100 80GB (SGLang, bf16): inter-token latency by running requests. Measured curve of Llama-3.1-8B
# on one H100 (vLLM, bf16, ML.Energy leaderboard, ml-energy/leaderboard@0cd52dab public/data/tasks/lm-arena-chat.json:
# 7.32 / 8.91 / 11.50 / 16.48 / 26.13 / 47.41 ms at 8 / 32 / 64 / 128 / 256 / 512 running; 7.2 ms at 1, SGLang Qwen3-8B,
# gpustack docs/performance-lab/qwen3-8b/h100-latency.md), times 0.4 for 3.09B against 8.03B parameters (decode is
# bound by reading weights and KV cache, both ~2.6-3.6x smaller for the 3B model).
H100_QWEN25_3B_ITL = ((1, 2.88e-3), (8, 2.93e-3), (32, 3.56e-3), (64, 4.60e-3), (128, 6.59e-3), (256, 10.45e-3),
                      (512, 18.96e-3))  # fmt: skip
# Llama-3.1-8B prefill on one H100 with SGLang: 27,670 tokens/s (sgl-project/sglang PR #1060); / 0.4 for 3B.
H100_QWEN25_3B_PREFILL = 69_000.0
# One NCCL push of a 1B-8B model from a trainer to SGLang on an 8xH100 node: 0.5-0.6 s
# (zhaochenyang20/Awesome-ML-SYS-Tutorial@c26a0206 sglang/latency-accelerate-for-weight-updates/readme.md).
H100_QWEN25_3B_PUSH_S = 0.5


@dataclass(frozen=True)
class GpuTiming:
    itl: tuple[tuple[int, float], ...] = H100_QWEN25_3B_ITL  # (running requests, seconds per decode step)
    prefill_tokens_per_s: float = H100_QWEN25_3B_PREFILL
    push_s: float = H100_QWEN25_3B_PUSH_S
    max_running: int = 1024  # KV cache: 80 GB x 0.8 - 6.2 GB weights at 36 KiB a token holds ~1.5M tokens
    time_scale: float = 1.0  # wall seconds per emulated second

    def step_s(self, running: int) -> float:
        """Seconds of one decode step with `running` requests: linear between the points, beyond them too."""
        sizes = [size for size, _ in self.itl]
        i = min(max(bisect.bisect_left(sizes, running), 1), len(sizes) - 1)
        (b0, t0), (b1, t1) = self.itl[i - 1], self.itl[i]
        return max(t0, t0 + (t1 - t0) * (running - b0) / (b1 - b0))


@dataclass
class Request:
    body: dict
    question: str
    planned: dict  # the recorded turn as SGLang answers it (ids, finish reason), before any token is "decoded"
    context: int  # tokens the model conditions on when it joins (prompt + output so far)
    future: asyncio.Future
    arrived: float  # loop time it reached the scheduler: it joins no step that began before
    produced: int = 0
    versions: list[tuple[str, int]] = field(default_factory=list)  # (version, first output index)


class EmulatedEngine:
    def __init__(self, tokenizer, script: dict[str, list[str]], timing: GpuTiming, weight_version: str = "0"):
        self.tokenizer = tokenizer
        self.script = script
        self.timing = timing
        self.version = weight_version
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.paused = asyncio.Event()  # set while paused
        self.work = asyncio.Event()
        self.cached: dict[str, set[int]] = {}  # question -> lengths of the sequences of its trajectories so far
        self.busy_s = 0.0  # emulated seconds spent decoding or prefilling
        # emulated seconds with nothing to decode (not paused): in all, and in gaps that began within
        # SOON_AFTER_UPDATE_S of a weight update's end (the next batch not yet admitted) or not
        self.idle_s = 0.0
        self.idle_after_update_s = 0.0
        self.idle_gaps = 0
        self.paused_s = 0.0  # emulated seconds paused (a push in fully asynchronous mode)
        # emulated seconds the GPU's clock fell behind and did not make up (beyond LAG_MADE_UP_S, or cut off by a
        # pause): this process's own Python (HTTP, JSON) holding the event loop, an emulation artefact, not the driver's
        self.late_s = 0.0
        self.max_lag_s = 0.0  # the largest lag the clock made up (emulated seconds)
        self._updated_at = float("-inf")
        self.decoded_tokens = 0
        self._clock = 0.0  # loop time the emulated GPU has reached: the end of its last step or idle gap (set by run)
        self._plans: dict[tuple, tuple[str, dict]] = {}  # (context ids, max_new_tokens, stops) -> (question, answer)

    # ---- what a request says -----------------------------------------------------------------------------------
    def question_of(self, prompt: str) -> str:
        """The recorded question the prompt asks (Search-R1's template ends with "Question: ...?")."""
        match = QUESTION.search(prompt)
        if match is None or match.group(1) not in self.script:
            raise KeyError("no recorded trajectory's question is in the prompt")
        return match.group(1)

    def plan(self, body: dict) -> tuple[str, dict]:
        """The request's question and its recorded turn as SGLang answers it, at the version served now. A
        question's samples follow one recorded trajectory, so they ask with the same context. The answer is worked
        out once per context and sampling parameters. Decoding and encoding on the engine's one event loop would
        hold its decode steps back, and that is time a GPU engine does not lose."""
        params = body.get("sampling_params", {})
        key = (tuple(body["input_ids"]), params.get("max_new_tokens"), tuple(params.get("stop") or ()))
        if key not in self._plans:
            if len(self._plans) >= PLANS_KEPT:
                self._plans.clear()
            prompt = self.tokenizer.decode(body["input_ids"])
            question = self.question_of(prompt)
            turns = self.script[question]
            trajectory = prompt.rpartition("<|im_start|>assistant\n")[2]
            turn = sum(trajectory.count(marker) for marker in OBSERVATION_MARKERS)
            text = turns[min(turn, len(turns) - 1)]
            planned = turn_response(self.tokenizer, text, body, weight_version=self.version, log_prob=lambda i: -0.5)
            self._plans[key] = (question, planned)
        question, planned = self._plans[key]
        return question, {**planned, "meta_info": {**planned["meta_info"], "weight_version": self.version}}

    def cached_tokens(self, question: str, length: int) -> int:
        """The prefix-cache hit of a request: its trajectory's earlier context, taken as the longest earlier sequence
        (prompt + output) of the same question no longer than this prompt (the question's samples share the prompt)."""
        return max((n for n in self.cached.get(question, ()) if n <= length), default=0)

    async def generate(self, body: dict) -> dict:
        while self.paused.is_set():
            await asyncio.sleep(0.01 * self.timing.time_scale)
        question, planned = self.plan(body)
        loop = asyncio.get_running_loop()
        request = Request(body, question, planned, len(body["input_ids"]), loop.create_future(), loop.time())
        self.waiting.append(request)
        self.work.set()
        return await request.future

    # ---- the scheduler ----------------------------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._clock = loop.time()
        while True:
            if self.paused.is_set():
                await self._wait_paused(loop)
            elif self.running or self._has_arrived():
                prefill = self.admit()
                step = self.timing.step_s(len(self.running)) + prefill / self.timing.prefill_tokens_per_s
                self._clock += step * self.timing.time_scale
                await self._keep_to_clock(loop)
                self.busy_s += step
                self.decode_one_token()
            elif self.waiting:  # the next request arrived after the GPU's clock: it idled until then
                self._count_idle(self._clock, self.waiting[0].arrived)
                self._clock = self.waiting[0].arrived
            else:
                self.work.clear()
                await self.work.wait()
                if self.paused.is_set():  # idle until the pause: the time paused is counted from there
                    now = loop.time()
                    self._count_idle(self._clock, now)
                    self._clock = max(self._clock, now)

    def _has_arrived(self) -> bool:
        return bool(self.waiting) and self.waiting[0].arrived <= self._clock

    async def _keep_to_clock(self, loop) -> None:
        """Sleep until the step's end on the GPU's clock; behind it, give the front end one turn and go on (the
        steps after make the lag up), up to LAG_MADE_UP_S; beyond that the lag is counted as late and dropped."""
        now = loop.time()
        if now < self._clock:
            await asyncio.sleep(self._clock - now)
            return
        lag, kept = now - self._clock, LAG_MADE_UP_S * self.timing.time_scale
        if lag > kept:
            self.late_s += (lag - kept) / self.timing.time_scale
            self._clock = now - kept
        self.max_lag_s = max(self.max_lag_s, min(lag, kept) / self.timing.time_scale)
        await asyncio.sleep(0)

    async def _wait_paused(self, loop) -> None:
        began = loop.time()
        if began > self._clock:  # the lag a pause cuts off is never made up
            self.late_s += (began - self._clock) / self.timing.time_scale
        self.work.clear()
        await self.work.wait()
        woke = loop.time()
        self.paused_s += (woke - began) / self.timing.time_scale
        self._clock = woke

    def _count_idle(self, began: float, ended: float) -> None:
        gap = (ended - began) / self.timing.time_scale
        self.idle_s += gap
        self.idle_gaps += 1
        if (began - self._updated_at) / self.timing.time_scale <= SOON_AFTER_UPDATE_S:
            self.idle_after_update_s += gap

    def admit(self) -> int:
        """Move waiting requests into the running batch; returns the tokens they need prefilled."""
        tokens = 0
        while self._has_arrived() and len(self.running) < self.timing.max_running:
            request = self.waiting.pop(0)
            cached = self.cached_tokens(request.question, request.context) if request.produced == 0 else 0
            tokens += max(0, request.context - cached)
            if not request.versions or request.versions[-1][0] != self.version:
                request.versions.append((self.version, request.produced))
            self.running.append(request)
        return tokens

    def decode_one_token(self) -> None:
        still = []
        for request in self.running:
            if request.produced < len(request.planned["output_ids"]):
                request.produced += 1
                self.decoded_tokens += 1
            if request.produced >= len(request.planned["output_ids"]):
                self.finish(request)
            else:
                still.append(request)
        self.running = still

    def finish(self, request: Request) -> None:
        out, meta = request.planned, request.planned["meta_info"]
        ends = [start for _, start in request.versions[1:]] + [request.produced]
        spans = [
            {"version": v, "start": s, "end": e} for (v, s), e in zip(request.versions, ends, strict=True) if e > s
        ]
        meta["weight_versions"] = spans or [{"version": self.version, "start": 0, "end": 0}]
        meta["weight_version"] = meta["weight_versions"][-1]["version"]
        self.cached.setdefault(request.question, set()).add(len(request.body["input_ids"]) + len(out["output_ids"]))
        if not request.future.done():
            request.future.set_result(out)

    # ---- control -------------------------------------------------------------------------------------------------
    def pause(self) -> None:
        """Retract: running requests keep their tokens and wait; they are prefilled again on continue."""
        self.paused.set()
        self.work.set()  # an idle scheduler wakes: the time paused is not idle
        for request in self.running:
            request.context = len(request.body["input_ids"]) + request.produced
        self.waiting = self.running + self.waiting
        self.running = []

    def resume(self) -> None:
        self.paused.clear()
        self.work.set()

    async def update(self, version: str | None) -> None:
        await asyncio.sleep(self.timing.push_s * self.timing.time_scale)
        if version is not None:
            self.version = version
        self._updated_at = asyncio.get_running_loop().time()


def build_app(engine: EmulatedEngine):
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.get_running_loop().create_task(engine.run())
        yield
        task.cancel()

    app = FastAPI(lifespan=lifespan)
    started = time.monotonic()

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        return Response(status_code=200)

    @app.get("/model_info")
    async def model_info():
        return {"weight_version": engine.version, "is_generation": True}

    @app.get("/server_info")
    async def server_info():
        wall = (time.monotonic() - started) / engine.timing.time_scale
        state = {
            "busy_s": engine.busy_s,
            "idle_s": engine.idle_s,
            "idle_after_update_s": engine.idle_after_update_s,
            "idle_gaps": engine.idle_gaps,
            "paused_s": engine.paused_s,
            "late_s": engine.late_s,
            "max_lag_s": engine.max_lag_s,
            "emulated_s": wall,
            "decoded_tokens": engine.decoded_tokens,
            "running": len(engine.running),
            "waiting": len(engine.waiting),
        }
        return {"version": "0.5.23", "internal_states": [state]}

    @app.post("/generate")
    async def generate(request: Request):
        try:
            # a JSONResponse of its own: FastAPI's default encoding walks every element of every answer first, on
            # the engine's one event loop (40% of its CPU), holding back the decode steps a GPU would keep to
            return JSONResponse(await engine.generate(await request.json()))
        except KeyError as err:
            return JSONResponse({"error": {"message": str(err)}}, status_code=400)

    @app.post("/pause_generation")
    async def pause_generation():
        engine.pause()
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation():
        engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        await engine.update((await request.json()).get("weight_version"))
        return {"success": True, "message": "emulated update", "num_paused_requests": 0}

    @app.post("/flush_cache")
    async def flush_cache():
        return Response("Cache flushed.", media_type="text/plain")

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn
    from transformers import AutoTokenizer

    from slime_search.utils.net import listen_socket

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--trajectories", nargs="+", required=True, help="Search-R1 trajectories jsonl files")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--time-scale", type=float, default=1.0, help="wall seconds per emulated second")
    parser.add_argument("--max-running", type=int, default=1024)
    parser.add_argument("--timing", default=None, help="JSON GpuTiming fields to override")
    args = parser.parse_args(argv)
    script = {}  # keyed as the prompt states the question
    for path in args.trajectories:
        script.update({normalize_question(q): turns for q, turns in script_from_trajectories(path).items()})
    overrides = json.loads(args.timing) if args.timing else {}
    if "itl" in overrides:
        overrides["itl"] = tuple(tuple(point) for point in overrides["itl"])
    timing = GpuTiming(**{"max_running": args.max_running, "time_scale": args.time_scale, **overrides})
    engine = EmulatedEngine(AutoTokenizer.from_pretrained(args.tokenizer), script, timing)
    sock = listen_socket("127.0.0.1", args.port)
    print(f"serving on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    asyncio.run(uvicorn.Server(uvicorn.Config(build_app(engine), log_level="warning")).serve(sockets=[sock]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
