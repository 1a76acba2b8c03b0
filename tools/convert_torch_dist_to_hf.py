"""Convert a Megatron torch_dist checkpoint back to a Hugging Face checkpoint (safetensors + config + tokenizer).

    source scripts/models/qwen2.5-3B.sh
    python tools/convert_torch_dist_to_hf.py "${MODEL_ARGS[@]}" --load ckpt_dir [--iteration N] \
        --hf-checkpoint Qwen2.5-3B --save Qwen2.5-3B_step_N

--hf-checkpoint is the original HF folder: its config, generation config and tokenizer files are copied over.
Loads at tensor-parallel size 1 in one process, whatever TP size the checkpoint was saved with.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None) -> argparse.Namespace:
    from slime_search.backends.megatron.model_args import add_model_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--load", required=True, help="torch_dist checkpoint folder (with latest_checkpointed_iteration.txt)"
    )
    parser.add_argument("--iteration", type=int, default=None, help="default: the latest")
    parser.add_argument("--hf-checkpoint", required=True, help="the original HF folder (config and tokenizer)")
    parser.add_argument("--save", required=True, help="output HF folder")
    add_model_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from slime_search.backends.megatron.checkpoint import latest_iteration

    original = Path(args.hf_checkpoint)
    if not (original / "config.json").is_file():
        print(f"error: {original} has no config.json: pass the original HF folder to --hf-checkpoint", file=sys.stderr)
        return 2
    if args.iteration is None and latest_iteration(args.load) is None:
        print(
            f"error: {args.load} is not a torch_dist checkpoint (no latest_checkpointed_iteration.txt)", file=sys.stderr
        )
        return 2

    from megatron_bridge import megatron_to_hf
    from megatron_bridge.hf_io import save_hf_folder
    from slime_search.backends.megatron.checkpoint import load_model
    from slime_search.backends.megatron.distributed import init_megatron, shutdown
    from slime_search.backends.megatron.model import build_gpt_model, uses_te_names
    from slime_search.backends.megatron.model_args import model_from_args
    from slime_search.utils.net import free_port

    init_megatron(0, 1, tp_size=1, master_port=free_port())
    shape, options = model_from_args(args)
    model = build_gpt_model(shape, options)
    iteration = load_model(model, args.load, args.iteration)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    hf_state = megatron_to_hf(state, shape, te_names=uses_te_names(model))
    if shape.tie_word_embeddings:
        hf_state.pop("lm_head.weight")  # tied: transformers rebuilds it from the embeddings
    save_hf_folder(hf_state, original, Path(args.save))
    shutdown()
    print(f"wrote {args.save} from iteration {iteration}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
