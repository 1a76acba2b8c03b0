"""Sentence encoders for dense retrieval, with each model family's query/passage conventions."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

BGE_QUERY_INSTRUCTION = "Represent this sentence for searching relevant passages: "
POOLINGS = ("mean", "cls")


@dataclass(frozen=True)
class EncoderConfig:
    model_path: str
    family: str = "auto"  # e5 | bge | plain | auto (from the model path)
    pooling: str = "auto"  # mean | cls | auto (cls for bge, mean otherwise)
    max_length: int = 256
    batch_size: int = 64  # on 2 CPU cores, 32-64 encodes ~35% faster than 128 (cache-resident activations)
    fp16: bool = False  # on GPU only

    def resolved_family(self) -> str:
        if self.family != "auto":
            return self.family
        name = self.model_path.lower()
        if "e5" in name:
            return "e5"
        if "bge" in name:
            return "bge"
        return "plain"

    def resolved_pooling(self) -> str:
        if self.pooling != "auto":
            if self.pooling not in POOLINGS:
                raise ValueError(f"unknown pooling {self.pooling!r}; valid: {', '.join(POOLINGS)}")
            return self.pooling
        return "cls" if self.resolved_family() == "bge" else "mean"


def add_prefix(texts: list[str], family: str, is_query: bool) -> list[str]:
    """e5 was trained with 'query: ' / 'passage: ' prefixes, bge with an instruction on queries only."""
    if family == "e5":
        prefix = "query: " if is_query else "passage: "
        return [prefix + t for t in texts]
    if family == "bge" and is_query:
        return [BGE_QUERY_INSTRUCTION + t for t in texts]
    return list(texts)


def length_batches(lengths: list[int], batch_size: int) -> list[np.ndarray]:
    """Row numbers in batches of texts of nearly one token count (at most an eighth, or one token, longer than the
    batch's shortest), at most `batch_size` each. Padding to the longest text of a batch is wasted compute: batches
    of 64 of 256 real Search-R1 queries sorted by characters were 36% padding, sorted by tokens 23%."""
    order = np.argsort(lengths, kind="stable")
    batches, start = [], 0
    for end in range(1, len(order) + 1):
        if end == len(order) or end - start == batch_size or lengths[order[end]] > _widest(lengths[order[start]]):
            batches.append(order[start:end])
            start = end
    return batches


def _widest(shortest: int) -> int:
    return shortest + max(1, shortest // 8)


class Encoder:
    """A Hugging Face encoder; returns L2-normalised float32 embeddings, so inner product = cosine.

    `runtime` runs its forward pass: "torch", "onnx" (ONNX Runtime, CPU only; onnx_forward.py) or "auto" (ONNX
    Runtime on CPU when installed). `threads` (ONNX Runtime's intra-op threads; 0: one per core) applies to ONNX
    Runtime only: torch's are the process's (`torch.set_num_threads`)."""

    def __init__(self, config: EncoderConfig, device: str | None = None, runtime: str = "torch", threads: int = 0):
        import torch
        from transformers import AutoModel, AutoTokenizer

        from local_dense_retriever.onnx_forward import resolve_runtime

        self.config = config
        self.family = config.resolved_family()
        self.pooling = config.resolved_pooling()
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.runtime = resolve_runtime(runtime, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        model = AutoModel.from_pretrained(config.model_path)
        if config.fp16 and self.device.startswith("cuda"):
            model = model.half()
        self.model = model.to(self.device).eval()
        self.dim = int(self.model.config.hidden_size)
        self._forward = self._torch_forward
        self.threads = torch.get_num_threads()
        if self.runtime == "onnx":
            self._use_onnx(threads)
        logger.info(
            "encoder %s (%s, %s pooling) on %s, %s",
            config.model_path,
            self.family,
            self.pooling,
            self.device,
            "ONNX Runtime" if self.runtime == "onnx" else "torch",
        )

    def _use_onnx(self, threads: int) -> None:
        """Export, check against torch on the probe texts, and serve with ONNX Runtime; torch where they differ."""
        from local_dense_retriever.onnx_forward import (
            MAX_EMBEDDING_DIFF,
            PROBE_TEXTS,
            OnnxForward,
            export_onnx,
            largest_difference,
        )

        probe_ids = self.tokenizer(list(PROBE_TEXTS), max_length=self.config.max_length, truncation=True)["input_ids"]
        # Exported from two short texts, checked on all three padded into one batch (another batch size and length,
        # and rows of unequal length): a graph that kept the example's shapes, or let padding reach the real tokens,
        # fails or differs here. encode() itself batches texts of nearly one length.
        example = self._padded([probe_ids[0], probe_ids[2]])
        graph = export_onnx(self.config.model_path, example["input_ids"], example["attention_mask"])
        tokens = self._padded(probe_ids)
        expected = self._embed(tokens).cpu().numpy()
        self._forward = OnnxForward(graph, threads)
        try:
            problem = None
            difference = largest_difference(self._embed(tokens).cpu().numpy(), expected)
            if difference > MAX_EMBEDDING_DIFF:
                problem = f"gives embeddings {difference:.2g} from torch's (at most {MAX_EMBEDDING_DIFF:.0e} allowed)"
        except Exception as err:  # noqa: BLE001 - any failure of the export's graph means torch serves
            problem = f"fails on a batch of another shape ({type(err).__name__}: {str(err)[:200]})"
        if problem is not None:
            logger.warning("the ONNX export of %s %s: serving with torch", self.config.model_path, problem)
            self._forward, self.runtime = self._torch_forward, "torch"
            return
        self.model = None  # ONNX Runtime holds its own copy of the weights
        self.threads = threads

    def _torch_forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def encode(self, texts: list[str], is_query: bool) -> np.ndarray:
        texts = add_prefix(texts, self.family, is_query)
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        ids = self.tokenizer(texts, max_length=self.config.max_length, truncation=True)["input_ids"]
        for rows in length_batches([len(i) for i in ids], self.config.batch_size):
            tokens = self._padded([ids[i] for i in rows])
            out[rows] = self._embed(tokens).cpu().numpy()
        return out

    def _embed(self, tokens: dict):
        """The pooled, L2-normalised embeddings of one padded batch."""
        import torch

        with torch.inference_mode():
            hidden = self._forward(tokens["input_ids"], tokens["attention_mask"]).float()
            if self.pooling == "cls":
                pooled = hidden[:, 0]
            else:
                mask = tokens["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
            return torch.nn.functional.normalize(pooled, dim=-1)

    def _padded(self, batch: list[list[int]]) -> dict:
        """input_ids and attention_mask of token lists padded on the right to the longest, on the encoder's device."""
        import torch

        width = max(map(len, batch))
        input_ids = torch.full((len(batch), width), self.tokenizer.pad_token_id or 0, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, seq in enumerate(batch):
            input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            attention_mask[row, : len(seq)] = 1
        return {"input_ids": input_ids.to(self.device), "attention_mask": attention_mask.to(self.device)}
