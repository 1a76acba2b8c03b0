"""Convert a Hugging Face Qwen2 / Qwen3 (dense) checkpoint into a Megatron torch_dist checkpoint.

    source scripts/models/qwen2.5-3B.sh
    python tools/convert_hf_to_torch_dist.py "${MODEL_ARGS[@]}" --hf-checkpoint Qwen2.5-3B --save Qwen2.5-3B_torch_dist

The model flags are checked against the checkpoint's config.json first. --tensor-model-parallel-size N starts N
local processes (gloo on CPU, NCCL on GPU); torch_dist stores global shapes, so the result loads at any TP size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None) -> argparse.Namespace:
    from slime_search.backends.megatron.model_args import add_model_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-checkpoint", required=True, help="HF folder: config.json + *.safetensors")
    parser.add_argument("--save", required=True, help="output torch_dist folder")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    add_model_arguments(parser)
    return parser.parse_args(argv)


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    from megatron_bridge.hf_io import read_hf_state
    from slime_search.backends.megatron.checkpoint import save_model
    from slime_search.backends.megatron.distributed import init_megatron, shutdown
    from slime_search.backends.megatron.model import build_gpt_model, load_hf_weights
    from slime_search.backends.megatron.model_args import model_from_args

    tp = args.tensor_model_parallel_size
    init_megatron(rank, tp, tp_size=tp, master_port=port)
    shape, options = model_from_args(args)
    model = build_gpt_model(shape, options)
    load_hf_weights(model, read_hf_state(args.hf_checkpoint), shape, options)
    save_model(model, args.save, iteration=0)
    shutdown()


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        validate(args)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    from slime_search.utils.net import free_port

    mp.spawn(_worker, args=(args, free_port()), nprocs=args.tensor_model_parallel_size, join=True)
    print(f"wrote {args.save}")
    return 0


def validate(args: argparse.Namespace) -> None:
    from transformers import AutoConfig

    from slime_search.backends.megatron.model_args import check_against_hf_config, model_from_args

    if args.pipeline_model_parallel_size != 1:
        raise ValueError(
            "pipeline parallelism is not supported by this converter; use --pipeline-model-parallel-size 1"
        )
    hf_dir = Path(args.hf_checkpoint)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir} has no config.json: pass an HF checkpoint folder to --hf-checkpoint")
    if not list(hf_dir.glob("*.safetensors")) and not list(hf_dir.glob("*.bin")):
        raise FileNotFoundError(f"{hf_dir} has no *.safetensors (or *.bin) weight files")
    shape, options = model_from_args(args)
    check_against_hf_config(shape, options, AutoConfig.from_pretrained(hf_dir))


if __name__ == "__main__":
    sys.exit(main())
