"""The GPU model configuration asks only for kernels that are installed (checked on CPU: the config is pure data)."""

import pytest
import torch

from megatron_bridge import ModelShape
from slime_search.backends.megatron import model as model_module
from slime_search.backends.megatron.model import ModelOptions, fused_softmax_kernels_available


def _gpu_config(monkeypatch, kernels: bool):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(model_module, "_tp_size", lambda: 1)
    monkeypatch.setattr(model_module, "fused_softmax_kernels_available", lambda: kernels)
    shape = ModelShape(2, 64, 4, 2, 128, 1000, True)
    return model_module.transformer_config(shape, ModelOptions(params_dtype=torch.bfloat16))


def test_the_local_attention_fuses_its_softmax_only_with_the_kernels_installed(monkeypatch):
    assert _gpu_config(monkeypatch, kernels=False).masked_softmax_fusion is False
    assert _gpu_config(monkeypatch, kernels=True).masked_softmax_fusion is True


def test_megatron_needs_the_kernels_when_the_fusion_is_on():
    """Why the gate exists: with the fusion on and bf16 scores of a packed row, Megatron imports the CUDA kernel."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType

    if fused_softmax_kernels_available():
        pytest.skip("the fused softmax kernels are installed here")
    softmax = FusedScaleMaskSoftmax(
        input_in_fp16=False,
        input_in_bf16=True,
        attn_mask_type=AttnMaskType.padding,
        scaled_masked_softmax_fusion=True,
        mask_func=lambda scores, mask: scores.masked_fill(mask, -10000.0),
        softmax_in_fp32=True,
        scale=None,
    )
    mask = torch.zeros(1, 1, 64, 64, dtype=torch.bool)
    with pytest.raises(ImportError, match="scaled_masked_softmax_cuda"):
        softmax.is_kernel_available(mask, 1, 4, 64, 64)
