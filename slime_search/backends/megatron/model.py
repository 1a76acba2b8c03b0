"""Build a Megatron-core GPTModel for a Qwen2 / Qwen3 checkpoint and move weights in and out of it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_bridge import ModelShape, hf_to_megatron, pad_vocab_size, shard_tensor_parallel


@dataclass(frozen=True)
class ModelOptions:
    make_vocab_size_divisible_by: int = 128
    rotary_base: float = 1_000_000.0
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    params_dtype: torch.dtype = torch.float32
    sequence_parallel: bool = False
    # the attention of each layer (--attention-impl): "te" TransformerEngine's layer spec, "local" Megatron's local
    # spec with its own attention (which scores a packed row whole), "packed" the local spec with PackedAttention;
    # "auto": TransformerEngine where it imports and CUDA is present, else "packed". Both local ones take
    # sequence parallelism (norms.py)
    attention_impl: str = "auto"
    # Megatron activation recomputation (--recompute-granularity full|selective, --recompute-method,
    # --recompute-num-layers): activations recomputed in the backward pass instead of kept
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None

    @classmethod
    def from_hf_config(cls, config, **overrides) -> ModelOptions:
        """The options config.json holds; `overrides` (any field, config.json's ones included) win."""
        from_config = {
            "rotary_base": float(
                getattr(config, "rope_theta", None) or getattr(config, "rope_parameters", {}).get("rope_theta", 1e6)
            ),
            "max_position_embeddings": int(config.max_position_embeddings),
            "rms_norm_eps": float(config.rms_norm_eps),
        }
        return cls(**{**from_config, **overrides})


ATTENTION_IMPLS = ("auto", "te", "local", "packed")


def te_available() -> bool:
    """Whether TransformerEngine's layer spec can be built here: CUDA is present and Megatron imported
    TransformerEngine (its TE modules refuse to be built otherwise). Finding the package is not enough: an install
    whose extension does not load for this torch is found, fails to import, and Megatron then runs without it."""
    if not torch.cuda.is_available():
        return False
    from slime_search.backends.megatron.imports import import_megatron_core

    import_megatron_core()
    from megatron.core.extensions import transformer_engine as megatron_te

    return megatron_te.HAVE_TE


def fused_softmax_kernels_available() -> bool:
    """Whether the local attention's fused masked softmax can run. Megatron imports its CUDA kernels whenever the fusion
    is on and the shapes allow it (bf16, keys up to 4096). Apex builds them, not Megatron-core or TransformerEngine.
    Without them the forward fails with ImportError. TransformerEngine's attention fuses its own."""
    import importlib.util

    return importlib.util.find_spec("scaled_masked_softmax_cuda") is not None


def transformer_config(shape: ModelShape, options: ModelOptions):
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = torch.cuda.is_available()
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        ffn_hidden_size=shape.ffn_hidden_size,
        kv_channels=shape.head_dim,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        layernorm_epsilon=options.rms_norm_eps,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=options.params_dtype,
        bf16=options.params_dtype == torch.bfloat16,
        use_cpu_initialization=not on_gpu,
        perform_initialization=True,
        sequence_parallel=options.sequence_parallel,
        tensor_model_parallel_size=_tp_size(),
        bias_dropout_fusion=on_gpu,
        apply_rope_fusion=False,
        masked_softmax_fusion=on_gpu and fused_softmax_kernels_available(),
        gradient_accumulation_fusion=False,
        recompute_granularity=options.recompute_granularity,
        recompute_method=options.recompute_method,
        recompute_num_layers=options.recompute_num_layers,
    )


def _tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def build_gpt_model(shape: ModelShape, options: ModelOptions):
    """A GPTModel with the shape's architecture (Qwen2 or Qwen3); model-parallel state must already be initialised."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    config = transformer_config(shape, options)
    impl = resolve_attention_impl(options.attention_impl)
    if impl == "te":
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=shape.qk_norm)
    else:
        spec = local_block_spec(config, shape.qk_norm, packed_attention=impl == "packed")
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=pad_vocab_size(shape.vocab_size, options.make_vocab_size_divisible_by, _tp_size()),
        max_sequence_length=options.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(options.rotary_base),
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        pre_process=True,
        post_process=True,
    )


def local_block_spec(config, qk_norm: bool, packed_attention: bool):
    """Megatron's local spec for every layer, with the RMSNorm of norms.py wherever the spec puts WrappedTorchNorm,
    which refuses sequence parallelism. That covers the layers' two norms, the q/k norms and the final norm after the
    last layer. Megatron would otherwise take the final norm from whatever it imported: TENorm, Apex's or
    WrappedTorchNorm; PackedAttention as the core attention when `packed_attention`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from slime_search.backends.megatron.norms import RMSNorm

    layer = get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm")
    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = RMSNorm
    attention = layer.submodules.self_attention.submodules
    if qk_norm:
        attention.q_layernorm = attention.k_layernorm = ModuleSpec(module=RMSNorm, params={"sequence_sharded": False})
    if packed_attention:
        from slime_search.backends.megatron.packed_attention import PackedAttention

        attention.core_attention = PackedAttention
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=RMSNorm)


def resolve_attention_impl(name: str) -> str:
    """The attention `name` (an ATTENTION_IMPLS entry) builds on this machine: "auto" is TransformerEngine when it can
    run, else the packed attention."""
    if name not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention implementation {name!r}: one of {', '.join(ATTENTION_IMPLS)}")
    if name == "auto":
        return "te" if te_available() else "packed"
    return name


def takes_packed_sequences(model) -> bool:
    """Whether the model's attention takes a packed row as THD (cumulative sample lengths) rather than as the row's
    block-diagonal mask: TransformerEngine's attention and PackedAttention do, Megatron's local attention does not."""
    from slime_search.backends.megatron.packed_attention import PackedAttention

    return uses_te_names(model) or any(isinstance(module, PackedAttention) for module in model.modules())


def uses_te_names(model) -> bool:
    return any(name.endswith("layer_norm_weight") for name in model.state_dict())


def load_hf_weights(model, hf_state: dict[str, torch.Tensor], shape: ModelShape, options: ModelOptions) -> None:
    """Copy an HF state dict into this rank's shard of the model; raises on any missing or unexpected tensor."""
    from megatron.core import parallel_state

    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    padded = pad_vocab_size(shape.vocab_size, options.make_vocab_size_divisible_by, tp_size)
    full = hf_to_megatron(hf_state, shape, padded, te_names=uses_te_names(model))
    shard = shard_tensor_parallel(full, shape, tp_size, tp_rank)
    target = model.state_dict()
    missing = [k for k in target if k not in shard and not k.endswith("_extra_state")]
    unexpected = [k for k in shard if k not in target]
    if missing or unexpected:
        raise KeyError(f"weight mapping mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, tensor in shard.items():
            if target[name].shape != tensor.shape:
                raise ValueError(f"{name}: model shape {tuple(target[name].shape)} vs checkpoint {tuple(tensor.shape)}")
            target[name].copy_(tensor.to(target[name].dtype))
