"""Core attention for Megatron's local layer spec that attends within each packed sample only (no TransformerEngine).

Megatron's own local attention (DotProductAttention) refuses packed sequence parameters. It takes the packed row's
block-diagonal causal mask instead, computes every score of the row and throws most away. So its time and memory grow
with the square of the packed length (measured in docs/benchmarks/megatron.md). This module takes the same THD input
TransformerEngine does: packed sequence parameters with cumulative sample lengths. It runs torch's
scaled_dot_product_attention once per sample, causal. The work is then the sum of the samples' squares, and the memory
is linear in the packed length. On CUDA in bf16, SDPA picks its flash kernel, which never materialises the scores.

Called without packed sequence parameters (a plain [s, b] batch), it honours the attention mask it is given, as the
local attention does. So a caller that builds its own mask sees the same numbers either way.
"""

from __future__ import annotations

import math

import torch
from megatron.core.transformer.module import MegatronModule


class PackedAttention(MegatronModule):
    """Drop-in for the local spec's `core_attention`: same constructor, same forward signature, no parameters."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("the packed attention has no context parallelism: use TransformerEngine's attention")
        if config.window_size is not None or config.softmax_type != "vanilla":
            raise ValueError("the packed attention supports full causal attention with a vanilla softmax only")
        # Megatron's default scale; apply_query_key_layer_scaling divides the scores by the layer number and its
        # softmax multiplies them back, so it changes nothing in exact arithmetic and is left out here.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """THD (`packed_seq_params.qkv_format == "thd"`): query [t, heads, d], key and value [t, groups, d], returns
        [t, heads * d]. Otherwise query [s, b, heads, d], key and value [s, b, groups, d], mask None (causal) or
        boolean [b or 1, 1, s, s] with True = masked, returns [s, b, heads * d]."""
        if attention_bias is not None:
            raise ValueError("the packed attention takes no attention bias")
        dropout = self.dropout if self.training else 0.0
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed sequences must come as THD, got {packed_seq_params.qkv_format!r}")
            cu = packed_seq_params.cu_seqlens_q
            if packed_seq_params.cu_seqlens_q_padded is not None:
                cu = packed_seq_params.cu_seqlens_q_padded
            lengths = (cu[1:] - cu[:-1]).tolist()
            # [t, h, d] -> per sample [1, h, n, d]; causal within the sample, nothing across samples
            outputs = [
                self._attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, dropout)
                for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths), strict=True)
            ]
            out = torch.cat([o[0].transpose(0, 1) for o in outputs])  # [t, h, d]
            return out.reshape(out.size(0), -1)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        allowed = None if attention_mask is None else ~attention_mask
        out = self._attend(q, k, v, allowed, dropout).permute(2, 0, 1, 3)  # [s, b, h, d]
        return out.reshape(out.size(0), out.size(1), -1)

    def _attend(self, q, k, v, allowed, dropout: float) -> torch.Tensor:
        """SDPA over [b, h, n, d]; keys and values of each query group serve its heads (GQA) without a copy where
        the kernel supports it. `allowed`: None for causal, else a boolean mask, True = may attend."""
        import torch.nn.functional as F

        gqa = q.size(1) != k.size(1)
        if dropout > 0:
            from megatron.core import tensor_parallel

            # the same RNG stream the local attention's dropout draws from
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    attn_mask=allowed,
                    dropout_p=dropout,
                    is_causal=allowed is None,
                    scale=self.softmax_scale,
                    enable_gqa=gqa,
                )
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, is_causal=allowed is None, scale=self.softmax_scale, enable_gqa=gqa
        )
