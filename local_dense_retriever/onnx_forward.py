"""The encoder's forward pass in ONNX Runtime, for serving queries on CPU.

On two cores ONNX Runtime ran MiniLM's forward pass 1.3x as fast as torch eager in batches of 64 queries and twice as
fast for one query (docs/benchmarks/retrieval.md, "The query encoder in ONNX Runtime"). The graph is exported from the
same Hugging Face weights at start, in memory, so there is no file to cache or go stale. Before it serves, it is checked
against torch on probe texts, padded into one batch. A family whose export differs is served by torch instead, with the
difference named.
"""

from __future__ import annotations

import io
import logging
import warnings

import numpy as np

logger = logging.getLogger(__name__)

RUNTIMES = ("auto", "torch", "onnx")
# Largest difference of a pooled, L2-normalised embedding from torch's that the export may show (float32
# reordering gives ~1e-7; a wrong export, e.g. a traced shape, gives 1e-2 and more).
MAX_EMBEDDING_DIFF = 1e-4
PROBE_TEXTS = (
    "who wrote the novel",
    "when did the river flood the valley of the old mill for the second time",
    "capital",
)


def onnx_importable() -> bool:
    """Whether both the exporter's `onnx` and `onnxruntime` are installed (the `cpu` extra has them)."""
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("onnx", "onnxruntime"))


def resolve_runtime(runtime: str, device: str) -> str:
    """`auto` is ONNX Runtime on CPU when installed, torch otherwise; `onnx` where it cannot run is an error."""
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown encoder runtime {runtime!r}; valid: {', '.join(RUNTIMES)}")
    if runtime == "torch":
        return "torch"
    usable = device == "cpu" and onnx_importable()
    if runtime == "onnx" and not usable:
        why = f"the encoder runs on {device}" if device != "cpu" else "onnx and onnxruntime are not installed"
        raise ValueError(f"--encoder-runtime onnx: {why} (pip install -e '.[cpu]' installs them on CPU)")
    return "onnx" if usable else "torch"


def _last_hidden_module(model):
    """The model as a function of (input_ids, attention_mask) only, the exporter's positional inputs."""
    import torch

    class LastHidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    return LastHidden()


def export_onnx(model_path: str, example_ids, example_mask) -> bytes:
    """The model's graph with batch and length dynamic, as bytes. Exported from a copy of its own: tracing leaves a
    module in a state whose later torch outputs differ, so the copy that serves or checks is never the traced one.
    Eager attention: its mask arithmetic traces into plain operators for any batch and length."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_path, attn_implementation="eager").eval()
    buffer = io.BytesIO()
    dynamic = {0: "batch", 1: "length"}
    # The tracer's warnings (shapes read as Python numbers, indexing) are about graphs that may not generalise; the
    # probe check in Encoder is what decides, so they would only be noise in the server's log.
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            _last_hidden_module(model),
            (example_ids, example_mask),
            buffer,
            input_names=["input_ids", "attention_mask"],
            output_names=["last_hidden_state"],
            dynamic_axes={"input_ids": dynamic, "attention_mask": dynamic, "last_hidden_state": dynamic},
            opset_version=17,
            dynamo=False,
        )
    return buffer.getvalue()


class OnnxForward:
    """An ONNX Runtime session over the exported graph; called like the model, returns last_hidden_state."""

    def __init__(self, graph: bytes, threads: int):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads  # 0: ONNX Runtime's default, one per core
        options.inter_op_num_threads = 1
        # Idle pool threads would spin on cores the server's clients share, taking their time.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])

    def __call__(self, input_ids, attention_mask):
        import torch

        feeds = {"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy()}
        return torch.from_numpy(self.session.run(None, feeds)[0])


def largest_difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max()) if a.size else 0.0
