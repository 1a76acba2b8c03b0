"""The query encoder's ONNX Runtime forward pass: the same embeddings as torch, where it runs, and its fall-back."""

import logging

import numpy as np
import pytest

from local_dense_retriever import onnx_forward
from local_dense_retriever.encoder import Encoder, EncoderConfig
from local_dense_retriever.onnx_forward import resolve_runtime
from tests.retriever_helpers import minilm_path

pytestmark = pytest.mark.timeout(300)

# unequal lengths, so that one padded batch holds rows of 3 to 60 tokens and the mask decides the pooling
TEXTS = [
    "otter",
    "where does the green heron live",
    "when did the river flood the valley of the old mill for the second time and who rebuilt the bridge " * 3,
    "which animal eats bison food in valley number 12",
]


@pytest.fixture(scope="module")
def torch_encoder():
    return Encoder(EncoderConfig(minilm_path(), max_length=64), runtime="torch")


@pytest.fixture(scope="module")
def onnx_encoder():
    return Encoder(EncoderConfig(minilm_path(), max_length=64), runtime="onnx", threads=1)


def test_onnx_embeddings_equal_torchs(torch_encoder, onnx_encoder):
    assert onnx_encoder.runtime == "onnx" and onnx_encoder.model is None  # torch's copy of the weights is freed
    for is_query in (True, False):
        expected = torch_encoder.encode(TEXTS, is_query=is_query)
        got = onnx_encoder.encode(TEXTS, is_query=is_query)
        assert got.shape == expected.shape == (len(TEXTS), 384) and got.dtype == np.float32
        assert np.abs(got - expected).max() < 1e-5


def test_one_padded_batch_of_unequal_lengths_gives_torchs_hidden_states(torch_encoder, onnx_encoder):
    """The encoder batches texts of nearly one length, so this batch (3 to 60 tokens) is built by hand: a graph that
    fixed the example's batch or length, or dropped the mask, would differ on the real tokens."""
    import torch

    ids = torch_encoder.tokenizer(TEXTS, max_length=64, truncation=True)["input_ids"]
    tokens = torch_encoder._padded(ids)
    assert tokens["attention_mask"].sum(1).tolist() == [len(i) for i in ids] and len(set(map(len, ids))) == 4
    with torch.inference_mode():
        expected = torch_encoder._forward(tokens["input_ids"], tokens["attention_mask"])
        got = onnx_encoder._forward(tokens["input_ids"], tokens["attention_mask"])
    real = tokens["attention_mask"].bool()
    assert got.shape == expected.shape
    assert (got[real] - expected[real]).abs().max().item() < 1e-4


def test_auto_is_onnx_on_cpu_and_torch_elsewhere():
    assert resolve_runtime("auto", "cpu") == "onnx"
    assert resolve_runtime("auto", "cuda") == "torch"
    assert resolve_runtime("torch", "cpu") == "torch"
    with pytest.raises(ValueError, match="runs on cuda"):
        resolve_runtime("onnx", "cuda")
    with pytest.raises(ValueError, match="unknown encoder runtime 'tvm'"):
        resolve_runtime("tvm", "cpu")


def test_without_onnxruntime_auto_is_torch_and_onnx_says_what_to_install(monkeypatch):
    monkeypatch.setattr(onnx_forward, "onnx_importable", lambda: False)
    assert resolve_runtime("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match=r"not installed \(pip install"):
        resolve_runtime("onnx", "cpu")


def test_an_export_that_differs_from_torch_is_not_served(monkeypatch, caplog, torch_encoder):
    """Any difference above the bound keeps torch, with a warning naming the model and the difference."""
    monkeypatch.setattr(onnx_forward, "MAX_EMBEDDING_DIFF", -1.0)
    with caplog.at_level(logging.WARNING, logger="local_dense_retriever.encoder"):
        encoder = Encoder(EncoderConfig(minilm_path(), max_length=64), runtime="onnx", threads=1)
    assert encoder.runtime == "torch" and encoder.model is not None
    assert "gives embeddings" in caplog.text and "serving with torch" in caplog.text
    np.testing.assert_array_equal(encoder.encode(TEXTS, is_query=True), torch_encoder.encode(TEXTS, is_query=True))


def test_an_export_that_keeps_its_examples_shapes_is_not_served(monkeypatch, caplog, torch_encoder):
    """A graph exported without dynamic batch and length fails on the check's batch of another shape: torch serves."""

    def export_with_fixed_shapes(model_path, example_ids, example_mask):
        import io
        import warnings

        import torch
        from transformers import AutoModel

        model = AutoModel.from_pretrained(model_path, attn_implementation="eager").eval()
        buffer = io.BytesIO()
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tracer's, as in the product's export
            torch.onnx.export(
                onnx_forward._last_hidden_module(model),
                (example_ids, example_mask),
                buffer,
                input_names=["input_ids", "attention_mask"],
                output_names=["last_hidden_state"],
                opset_version=17,
                dynamo=False,
            )
        return buffer.getvalue()

    monkeypatch.setattr(onnx_forward, "export_onnx", export_with_fixed_shapes)
    with caplog.at_level(logging.WARNING, logger="local_dense_retriever.encoder"):
        encoder = Encoder(EncoderConfig(minilm_path(), max_length=64), runtime="onnx", threads=1)
    assert encoder.runtime == "torch" and encoder.model is not None
    assert "fails on a batch of another shape" in caplog.text and "serving with torch" in caplog.text
    np.testing.assert_array_equal(encoder.encode(TEXTS, is_query=True), torch_encoder.encode(TEXTS, is_query=True))
