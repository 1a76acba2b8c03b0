"""A CPU inference engine over a transformers causal LM: batched prefill and decode with a KV cache.

It is the rollout engine of CPU runs and tests, and it answers the same questions SGLang answers on GPU. For a batch of
token-id prompts with per-request sampling parameters, it gives the generated ids, their log-probs at the rollout
temperature, the text, and why each generation stopped.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from slime_search.engines.cpu_engine_lora import CpuAdapters
from slime_search.engines.sampling import SamplingParams, sample_tokens

logger = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    output_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: dict = field(default_factory=dict)
    prompt_tokens: int = 0
    # (version, first output index) each time the served weights changed under the request, as SGLang records them
    version_starts: list[tuple[str, int]] = field(default_factory=list)
    retracted: bool = False  # stopped by a pause (retract): continues after /continue_generation
    num_retractions: int = 0
    input_log_probs: list[float | None] = field(default_factory=list)  # from the request's logprob start on

    @property
    def weight_version(self) -> str:
        """The version the request finished on (SGLang reports the last span's)."""
        return self.version_starts[-1][0] if self.version_starts else ""

    def weight_versions(self) -> list[dict]:
        """SGLang's spans: {"version", "start", "end"} over the output tokens, one per version that produced any."""
        ends = [start for _, start in self.version_starts[1:]] + [len(self.output_ids)]
        spans = [
            {"version": v, "start": start, "end": end}
            for (v, start), end in zip(self.version_starts, ends, strict=True)
        ]
        return [span for span in spans if span["end"] > span["start"]] or spans[-1:]

    def serve_on(self, version: str) -> None:
        if not self.version_starts or self.version_starts[-1][0] != version:
            self.version_starts.append((version, len(self.output_ids)))


@dataclass
class GenerationRequest:
    input_ids: list[int]
    params: SamplingParams
    rid: str = ""
    prior: GenerationResult | None = None  # what a retracted request generated before its pause
    logprob_start: int | None = None  # SGLang's logprob_start_len: the input log-probs from this token on
    lora: str | None = None  # SGLang's lora_path: the loaded adapter to answer with (None: the base model)

    @property
    def context(self) -> list[int]:
        """What the model conditions on: the prompt and, for a retracted request, its output so far."""
        return self.input_ids + (self.prior.output_ids if self.prior is not None else [])


ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}  # SGLang's finish reason
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's; the CPU engine holds memory only for weights
PAUSE_MODES = ("abort", "retract")  # SGLang's /pause_generation modes the CPU engine has ("in_place" keeps a KV cache
# across a weight update, which the CPU engine does not keep beyond one batch)


class EngineNotReady(RuntimeError):
    """The engine cannot generate now: its weights are released, or resumed but not yet all updated."""


@dataclass(frozen=True)
class InjectedFaults:
    """Faults the CPU engine can be told to have, for measuring what a run does about them (the health benchmarks). One
    is a slow decoder, so that weight pushes interrupt trajectories. The other is a stale engine: it acknowledges weight
    updates after a version but keeps serving the weights it had. Only the trainer-engine log-prob gap shows it."""

    decode_delay_s: float = 0.0  # added to every decode step
    freeze_weights_after: int | None = None  # updates from disk to a later (numeric) version change the version only


class CpuEngine:
    def __init__(
        self,
        model_path: str | Path,
        seed: int = 0,
        weight_version: str = "default",
        faults: InjectedFaults = InjectedFaults(),  # noqa: B008 - a frozen dataclass
        device: str = "cpu",
    ):
        """`device`: where the model runs ("cuda" puts the stand-in next to a GPU actor); sampling stays on the CPU
        generator, so a seed draws the same tokens from the same logits on either device."""
        from transformers import AutoTokenizer

        self.model_path = str(model_path)
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = self._load_model(self.model_path)
        self.generator = torch.Generator().manual_seed(seed)
        self.weight_version = weight_version
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_ids = self._eos_ids()
        self._aborted: set[str] = set()
        self._abort_all = False
        self._pause_mode: str | None = None
        self._lock = threading.Lock()
        self.released: set[str] = set()  # memory tags given back (SGLang's release_memory_occupation)
        self.stale: set[str] = set()  # weights resumed but not updated since (their values are undefined)
        self.faults = faults
        self.adapters = CpuAdapters()  # the LoRA adapters loaded by name (cpu_engine_lora.py)

    def _load_model(self, path: str):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(self.device).eval()

    def _eos_ids(self) -> set[int]:
        ids = set()
        for source in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(int(i) for i in source)
        return ids

    # ---- control, callable from any thread --------------------------------------------------------------------
    def abort(self, rid: str | None) -> None:
        with self._lock:
            if rid:
                self._aborted.add(rid)
            else:
                self._abort_all = True

    def _is_aborted(self, rid: str) -> bool:
        with self._lock:
            return self._abort_all or rid in self._aborted or self._pause_mode == "abort"

    def pause(self, mode: str) -> None:
        """SGLang's pause: "abort" ends running requests (their output so far is returned), "retract" stops them at the
        next token and keeps their output for `GenerationResult.retracted` continuations; either way no request
        starts decoding until resume()."""
        if mode not in PAUSE_MODES:
            raise ValueError(
                f"pause mode {mode!r} is not supported by the CPU engine (it has {', '.join(PAUSE_MODES)})"
            )
        with self._lock:
            self._pause_mode = mode

    def resume(self) -> None:
        with self._lock:
            self._pause_mode = None

    def _retracting(self) -> bool:
        with self._lock:
            return self._pause_mode == "retract"

    # ---- memory hand-over with a colocated trainer (call between generations only) ---------------------------
    @staticmethod
    def _check_tags(tags: list[str] | None) -> set[str]:
        tags = set(MEMORY_TAGS if tags is None else tags)
        unknown = sorted(tags - set(MEMORY_TAGS))
        if unknown:
            raise ValueError(f"unknown memory tags {unknown} (known: {', '.join(MEMORY_TAGS)})")
        return tags

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Give back the memory of `tags` (all by default). Released weights are dropped, not kept anywhere."""
        tags = self._check_tags(tags)
        if "weights" in tags and "weights" not in self.released:
            self._shapes = {name: param.shape for name, param in self.model.named_parameters()}
            for param in self.model.parameters():
                param.data = torch.empty(0, dtype=param.dtype)
        self.released |= tags

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Take the memory back. Resumed weights hold zeros until every one of them has been updated."""
        tags = self._check_tags(tags)
        if "weights" in tags and "weights" in self.released:
            for name, param in self.model.named_parameters():
                param.data = torch.zeros(self._shapes[name], dtype=param.dtype, device=self.device)
            self.stale = set(self._shapes)
        self.released -= tags

    def _check_ready(self) -> None:
        if "weights" in self.released:
            raise EngineNotReady("weights are released: POST /resume_memory_occupation, then update the weights")
        if self.stale:
            raise EngineNotReady(
                f"weights were resumed but {len(self.stale)} tensors have not been updated since "
                f"(e.g. {sorted(self.stale)[0]})"
            )

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> str:
        """Load new weights (HF safetensors dir) of the same architecture; call between generations only."""
        if "weights" in self.released:
            raise ValueError("weights are released: POST /resume_memory_occupation first")
        if self._frozen(weight_version):
            self.weight_version = weight_version
            return self.weight_version
        new = self._load_model(model_path)
        if new.config.to_dict() | {"_name_or_path": ""} != self.model.config.to_dict() | {"_name_or_path": ""}:
            differing = sorted(k for k, v in new.config.to_dict().items() if self.model.config.to_dict().get(k) != v)
            raise ValueError(f"checkpoint at {model_path} has a different model config ({', '.join(differing[:5])})")
        self.model = new
        self.model_path = model_path
        self.stale = set()
        self.adapters.refold(self.model)
        if weight_version is not None:  # as SGLang: the version changes only when one is given
            self.weight_version = weight_version
        return self.weight_version

    @torch.no_grad()
    def load_named_tensors(self, tensors: dict[str, torch.Tensor], weight_version: str | None = None) -> str:
        """Copy HF-named tensors into the model (some or all of them); every name and shape is checked before
        anything is copied. The version changes only when `weight_version` is given (the last bucket)."""
        if "weights" in self.released:
            raise ValueError("weights are released: POST /resume_memory_occupation first")
        state = self.model.state_dict()
        unknown = sorted(name for name in tensors if name not in state)
        if unknown:
            raise ValueError(f"the model has no weights named {', '.join(unknown[:5])}")
        wrong = [
            f"{n} {list(t.shape)} (model: {list(state[n].shape)})"
            for n, t in tensors.items()
            if t.shape != state[n].shape
        ]
        if wrong:
            raise ValueError(f"shape mismatch: {'; '.join(wrong[:5])}")
        for name, tensor in tensors.items():
            state[name].copy_(tensor)
        self.stale -= set(tensors)
        self.adapters.refold(self.model)
        if weight_version is not None:
            self.weight_version = weight_version
        return self.weight_version

    def _frozen(self, version: str | None) -> bool:
        """Whether an update to `version` is one the injected stale-engine fault ignores."""
        after = self.faults.freeze_weights_after
        return after is not None and version is not None and str(version).isdigit() and int(version) > after

    # ---- generation ----------------------------------------------------------------------------------------------
    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Every request answered, in order; the requests of each adapter (or of none) run as one batch, with the
        model that adapter is folded into."""
        if not requests:
            return []
        self._check_ready()
        with self._lock:  # an abort-all applies to what was queued before it, not to later requests
            self._abort_all = False
        groups: dict[str | None, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(request.lora, []).append(index)
        results: list[GenerationResult | None] = [None] * len(requests)
        for lora, indices in groups.items():
            model = self.model if lora is None else self.adapters.model(lora)
            for index, result in zip(indices, self._generate_batch([requests[i] for i in indices], model), strict=True):
                results[index] = result
        return results

    @torch.inference_mode()
    def _generate_batch(self, requests: list[GenerationRequest], model) -> list[GenerationResult]:
        from transformers import DynamicCache

        results = [self._start(request, model) for request in requests]
        active = [self._finish_if_empty(req, res) for req, res in zip(requests, results, strict=True)]
        if self._retracting():  # paused before the batch started: every request waits, untouched
            return [self._retract(res) if on else res for res, on in zip(results, active, strict=True)]
        batch = len(requests)
        contexts = [request.context for request in requests]
        lengths = [len(c) for c in contexts]
        width = max(lengths)
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for row, context in enumerate(contexts):  # left padding: every row's next token is at the last column
            input_ids[row, width - lengths[row] :] = torch.tensor(context, dtype=torch.long)
            attention[row, width - lengths[row] :] = 1
        positions = (attention.cumsum(-1) - 1).clamp_min(0)
        temperature = torch.tensor([r.params.temperature for r in requests], dtype=torch.float32)
        top_p = torch.tensor([r.params.top_p for r in requests], dtype=torch.float32)
        top_k = torch.tensor([r.params.top_k for r in requests], dtype=torch.long)

        input_ids, attention, positions = (
            input_ids.to(self.device),
            attention.to(self.device),
            positions.to(self.device),
        )
        cache = DynamicCache()
        out = model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        seeds = [request.params.sampling_seed for request in requests]
        drawn = 0  # tokens sampled so far in this batch: each row's next token is at lengths[row] + drawn
        while any(active):
            seeded = [
                None if seed is None else (seed, length + drawn) for seed, length in zip(seeds, lengths, strict=True)
            ]
            tokens, log_probs = sample_tokens(
                out.logits[:, -1].cpu(), temperature, top_p, top_k, self.generator, seeded
            )
            drawn += 1
            for row, request in enumerate(requests):
                if active[row]:
                    active[row] = self._append(request, results[row], int(tokens[row]), float(log_probs[row]))
            if not any(active):
                break
            if self._retracting():  # a pause: the unfinished requests stop here and continue after it
                for row in range(batch):
                    if active[row]:
                        self._retract(results[row])
                break
            attention = torch.cat([attention, torch.ones((batch, 1), dtype=torch.long, device=self.device)], dim=1)
            positions = positions[:, -1:] + 1
            if self.faults.decode_delay_s:
                time.sleep(self.faults.decode_delay_s)
            out = model(
                input_ids=tokens.unsqueeze(-1).to(self.device),
                attention_mask=attention,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )
        with self._lock:  # a retracted request is still running: an abort of its rid still applies to it
            self._aborted.difference_update(
                request.rid for request, result in zip(requests, results, strict=True) if not result.retracted
            )
        return results

    def _start(self, request: GenerationRequest, model) -> GenerationResult:
        """A new result, or a retracted request's own, carried on under the weights served now. A new one asking for
        input log-probs gets them now, at its prefill, as SGLang computes them."""
        result = request.prior or GenerationResult(prompt_tokens=len(request.input_ids))
        if request.prior is None and request.logprob_start is not None:
            result.input_log_probs = self.input_log_probs(request.input_ids, request.logprob_start, model)
        result.retracted = False
        result.serve_on(self.weight_version)
        return result

    @torch.inference_mode()
    def input_log_probs(self, input_ids: list[int], start: int, model=None) -> list[float | None]:
        """SGLang's input_token_logprobs from token `start` on: each input token's log-prob given the tokens before it.
        They are of the model's own distribution, at temperature 1 whatever the request samples at. SGLang 0.5.23
        divides by the temperature only for the tokens it samples. The first token of the range gets None, as SGLang
        gives none there, also when tokens precede it. `model`: an adapter's folded copy (default: the base model)."""
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        logits = (model or self.model)(input_ids=ids).logits[0, start:-1].float()
        targets = ids[0, start + 1 :].unsqueeze(-1)
        log_probs = (logits.gather(-1, targets).squeeze(-1) - logits.logsumexp(-1)).cpu()
        return [None, *log_probs.tolist()] if start < len(input_ids) else []

    @staticmethod
    def _retract(result: GenerationResult) -> GenerationResult:
        result.retracted = True
        result.num_retractions += 1
        return result

    def _finish_if_empty(self, request: GenerationRequest, result: GenerationResult) -> bool:
        if request.params.max_new_tokens <= len(result.output_ids):
            result.finish_reason = {"type": "length", "length": request.params.max_new_tokens}
            return False
        if self._is_aborted(request.rid):
            result.finish_reason = {"type": "abort", "message": "Abort in waiting queue"}  # SGLang's words
            result.text = self.tokenizer.decode(
                result.output_ids,
                skip_special_tokens=request.params.skip_special_tokens,
                spaces_between_special_tokens=request.params.spaces_between_special_tokens,
            )
            return False
        return True

    def _append(self, request: GenerationRequest, result: GenerationResult, token: int, log_prob: float) -> bool:
        """Record one generated token; return whether the row continues. As SGLang: output_ids keep every generated
        token (the stop token too), and the text leaves the stop token or string out unless no_stop_trim."""
        params = request.params
        result.output_ids.append(token)
        result.log_probs.append(log_prob)
        trim = not params.no_stop_trim

        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(
                ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )

        if token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos):
            text = decode(result.output_ids[:-1] if trim else result.output_ids)
            return _finish(result, {"type": "stop", "matched": token}, text)
        if params.stop:  # decoding every step costs O(n) per token; only stop strings need the running text
            text = decode(result.output_ids)
            hits = [(text.find(s), s) for s in params.stop if s in text]
            if hits:
                position, matched = min(hits)
                return _finish(result, {"type": "stop", "matched": matched}, text[:position] if trim else text)
        if len(result.output_ids) >= params.max_new_tokens:
            return _finish(result, {"type": "length", "length": params.max_new_tokens}, decode(result.output_ids))
        if self._is_aborted(request.rid):
            return _finish(result, dict(ABORTED), decode(result.output_ids))
        return True


def _finish(result: GenerationResult, reason: dict, text: str) -> bool:
    result.finish_reason, result.text = reason, text
    return False
