"""What LoRA saves: an actor rank's memory, a checkpoint's bytes and a weight push's bytes, full fine-tuning vs LoRA.

    python -m benchmarks.perf.lora_bytes                      # Qwen2.5-3B at TP 2 (the recipe's), bf16, LoRA rank 32
    python -m benchmarks.perf.lora_bytes --shape tiny --tp 1 --rank 4

Each case builds the Megatron model in processes of its own (one per TP rank, gloo) on the meta device: the real
model, its real LoRA adapters, no memory for either. From the built model, per rank: the weights, the fp32 gradients
and Adam's state of what trains (backends/megatron/memory.py; without the distributed optimizer); a checkpoint's bytes
(backends/megatron/checkpoint_size.py: what trains once, its optimizer state per TP slice); and a push: the weights with
the adapters folded in (what --update-weight-transport sends) or the adapters alone under PEFT's names (what
--lora-sync-from-tensor sends: a fused projection's A once for each HF projection it stands for). Activations are not
counted.

Its figures: `docs/benchmarks/lora.md`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

GIB = 1024**3
SHAPES = {
    # scripts/models/qwen2.5-3B.sh
    "3B": dict(
        num_layers=36, hidden_size=2048, num_heads=16, num_kv_heads=2, ffn_hidden_size=11008, vocab_size=151936,
        tie_word_embeddings=True, qkv_bias=True, qk_norm=False,
    ),
    # slime_search.models.tiny_qwen's shape
    "tiny": dict(
        num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128, vocab_size=151936,
        tie_word_embeddings=True, qkv_bias=True, qk_norm=False,
    ),
}  # fmt: skip


def _worker(rank: int, world: int, port: int, shape_name: str, lora_rank: int, bf16: bool, out: str) -> None:
    import torch

    from megatron_bridge import ModelShape
    from slime_search.backends.megatron.checkpoint_size import rank_parameters
    from slime_search.backends.megatron.distributed import init_megatron, shutdown
    from slime_search.backends.megatron.lora import apply_lora, is_adapter, lora_modules
    from slime_search.backends.megatron.memory import actor_memory
    from slime_search.backends.megatron.model import ModelOptions, build_gpt_model
    from slime_search.config.lora import PROJECTIONS, LoraConfig

    init_megatron(rank, world, tp_size=world, master_port=port)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    dtype = torch.bfloat16 if bf16 else torch.float32
    options = ModelOptions(params_dtype=dtype, sequence_parallel=world > 1, attention_impl="packed")
    with torch.device("meta"):
        model = build_gpt_model(ModelShape(**SHAPES[shape_name]), options)
        apply_lora(model, LoraConfig(lora_rank=lora_rank))
    memory = actor_memory(model)
    trained, own = rank_parameters(model)
    named = list(model.named_parameters())
    own_adapters = sum(p.numel() for n, p in named if is_adapter(n) and param_is_not_tensor_parallel_duplicate(p))
    own_base = sum(p.numel() for n, p in named if not is_adapter(n) and param_is_not_tensor_parallel_duplicate(p))
    # a push names PEFT's projections: a fused projection's A goes once for each HF projection it stands for
    shared_a_copies = sum(
        (len(PROJECTIONS[path.rsplit(".", 1)[-1]]) - 1) * module.linear_in.weight.numel()
        for path, module in lora_modules(model)
    )
    record = {
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "memory": memory.__dict__,
        "trained": trained,
        "own": own,
        "own_adapters": own_adapters,
        "own_base": own_base,
        "shared_a_copies": shared_a_copies,
        "param_bytes": next(model.parameters()).element_size(),
    }
    Path(f"{out}.{rank}.json").write_text(json.dumps(record))
    shutdown()


def measure(shape_name: str, tp: int, lora_rank: int, bf16: bool) -> dict:
    import torch.multiprocessing as mp

    from slime_search.backends.megatron.checkpoint_size import checkpoint_bytes, layout_of_ranks
    from slime_search.utils.net import free_port

    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "rank")
        mp.spawn(_worker, args=(tp, free_port(), shape_name, lora_rank, bf16, out), nprocs=tp, join=True)
        ranks = [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(tp)]
    param_bytes = ranks[0]["param_bytes"]
    layout = layout_of_ranks([(r["tp_rank"], r["trained"], r["own"]) for r in ranks], param_bytes)
    slices = {r["tp_rank"]: r for r in ranks}.values()  # one data-parallel replica
    adapters, base = sum(r["own_adapters"] for r in slices), sum(r["own_base"] for r in slices)
    pushed_adapters = adapters + sum(r["shared_a_copies"] for r in slices)
    memory = ranks[0]["memory"]
    return {
        "rank_gib": sum(memory[k] for k in ("weight_bytes", "gradient_bytes", "optimizer_bytes")) / GIB,
        "weights_gib": memory["weight_bytes"] / GIB,
        "gradients_gib": memory["gradient_bytes"] / GIB,
        "optimizer_gib": memory["optimizer_bytes"] / GIB,
        "trained": memory["trainable"],
        "checkpoint_gb": checkpoint_bytes(layout) / 1e9,
        "optimizer_in_checkpoint_gb": layout.optimizer_bytes() / 1e9,
        # a push carries the model without adapters (folded in), or the adapters alone under PEFT's names
        "push_merged_gb": base * param_bytes / 1e9,
        "push_adapters_gb": pushed_adapters * param_bytes / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="3B")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank (a multiple of --tp)")
    parser.add_argument("--fp32", action="store_true", help="fp32 parameters (default bf16, as on GPU)")
    args = parser.parse_args(argv)
    rows = {
        "full": measure(args.shape, args.tp, 0, not args.fp32),
        f"lora{args.rank}": measure(args.shape, args.tp, args.rank, not args.fp32),
    }
    columns = list(rows["full"])
    print(f"{args.shape} TP {args.tp} {'fp32' if args.fp32 else 'bf16'}: " + " ".join(columns))
    for name, row in rows.items():
        print(name, " ".join(f"{row[c]:.4g}" for c in columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
