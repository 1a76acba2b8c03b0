"""Build tiny Qwen2 / Qwen3 policies offline (no hub access), each saved with its real tokenizer
(slime_search.models.qwen2_tokenizer, qwen3_tokenizer).

The tiny policy is a `Qwen2ForCausalLM` (or, with --family qwen3, a `Qwen3ForCausalLM`:
no q/k/v bias, q/k RMSNorm, a head size of its own) with random weights and Qwen2.5's padded vocab.

    python -m slime_search.models.tiny_qwen OUT_DIR [--family qwen3] [--hidden-size 64 --num-layers 2 --seed 0]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from slime_search.models.qwen2_tokenizer import build_qwen2_tokenizer

QWEN25_PADDED_VOCAB = 151936


@dataclass(frozen=True)
class TinyQwenConfig:
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = QWEN25_PADDED_VOCAB
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    rope_theta: float = 1_000_000.0  # Qwen2.5's; short-context models trained from scratch want ~1e4
    seed: int = 0
    eos_token_id: int = 151643  # <|endoftext|> of Qwen2's tokenizer
    end_of_turn_id: int = 151645  # <|im_end|>: Qwen3's config.json names it as the model's eos
    family: str = "qwen2"  # or "qwen3"
    head_dim: int = 32  # Qwen3 only: not hidden_size / num_heads (16 here), as in Qwen3-4B (2560 / 32 vs 128)


def build_tiny_qwen(config: TinyQwenConfig = TinyQwenConfig()):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if config.family not in ("qwen2", "qwen3"):
        raise ValueError(f"unknown family {config.family!r}: qwen2 or qwen3")
    qwen3 = config.family == "qwen3"
    config_class, model_class = (Qwen3Config, Qwen3ForCausalLM) if qwen3 else (Qwen2Config, Qwen2ForCausalLM)
    extra = {"head_dim": config.head_dim, "attention_bias": False} if qwen3 else {}
    hf_config = config_class(
        **extra,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_theta=config.rope_theta,
        rms_norm_eps=1e-6,
        bos_token_id=config.eos_token_id,
        eos_token_id=config.end_of_turn_id if qwen3 else config.eos_token_id,  # Qwen3's config.json: <|im_end|>
        torch_dtype="float32",
    )
    torch.manual_seed(config.seed)
    model = model_class(hf_config).eval()
    if qwen3:
        model.generation_config = qwen3_generation_config(config)
    if qwen3:  # HF initialises the q/k norms to ones: random ones make a round trip or a parity test see them
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    weight.uniform_(0.5, 1.5)
    return model


def qwen3_generation_config(config: TinyQwenConfig):
    """The published Qwen3's generation_config.json ids: a turn ends at <|im_end|> or <|endoftext|>, and the pad is
    <|endoftext|>. SGLang and the CPU engine take their stop tokens from it, so a tiny model without the second
    would run past an <|endoftext|> that the real one stops at. Its sampling defaults (temperature 0.6, top-k 20,
    top-p 0.95) are left out: a test's request says how it samples."""
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=config.eos_token_id,
        eos_token_id=[config.end_of_turn_id, config.eos_token_id],
        pad_token_id=config.eos_token_id,
    )


def save_tiny_checkpoint(out_dir: str | Path, config: TinyQwenConfig = TinyQwenConfig()) -> Path:
    """Write an HF checkpoint (safetensors + config + tokenizer) that loads with from_pretrained offline."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tiny_qwen(config).save_pretrained(out_dir, safe_serialization=True)
    if config.family == "qwen3":
        from slime_search.models.qwen3_tokenizer import build_qwen3_tokenizer

        build_qwen3_tokenizer().save_pretrained(out_dir)
    else:
        build_qwen2_tokenizer().save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=("qwen2", "qwen3"), default="qwen2")
    args = parser.parse_args(argv)
    config = TinyQwenConfig(
        hidden_size=args.hidden_size, num_layers=args.num_layers, seed=args.seed, family=args.family
    )
    path = save_tiny_checkpoint(args.out_dir, config)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
