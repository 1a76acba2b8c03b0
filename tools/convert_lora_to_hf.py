"""Convert a LoRA run's torch_dist checkpoint (its adapters) to a PEFT adapter folder, and optionally to the whole HF
model with the adapters folded in.

    source scripts/models/qwen2.5-3B.sh
    python tools/convert_lora_to_hf.py --load RUN/checkpoints [--iteration N] \
        --save Qwen2.5-3B_lora_step_N [--save-merged Qwen2.5-3B_step_N] ["${MODEL_ARGS[@]}"]

--save gets adapter_config.json and adapter_model.safetensors, which PEFT (`PeftModel.from_pretrained`) and SGLang
(`--lora-paths`) load onto the base model. --save-merged gets the HF checkpoint of the base with the adapters folded in.
A LoRA checkpoint holds the adapters and not the frozen base. The base is rebuilt from where the run took it, which the
checkpoint records (--hf-checkpoint, and --load when the run started from a torch_dist folder). The flags
--hf-checkpoint and --base-load override them. The model is built as the run built it: from config.json, with the model
flags the run was given (optional, as in training). Runs at tensor-parallel size 1 in one process, whatever TP size the
run trained at.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None) -> argparse.Namespace:
    from slime_search.backends.megatron.model_args import add_model_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", required=True, help="the LoRA run's checkpoint folder (its --save/checkpoints)")
    parser.add_argument("--iteration", type=int, default=None, help="default: the latest")
    parser.add_argument("--save", required=True, help="output PEFT adapter folder")
    parser.add_argument("--save-merged", default=None, help="output HF folder of the model with the adapters folded in")
    parser.add_argument(
        "--hf-checkpoint", default=None, help="the base HF folder (default: the one the checkpoint records)"
    )
    parser.add_argument(
        "--base-load",
        default=None,
        help="torch_dist folder of the frozen base, where the run started from one (default: the --load it recorded)",
    )
    add_model_arguments(parser, required=False)  # optional, as in training: the model is config.json's
    return parser.parse_args(argv)


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def model_as_trained(original: Path, args: argparse.Namespace):
    """The shape and options the run built: config.json's, with the vocab padding and context length the model flags
    gave it (run_config.model_source), and the local linears the adapters wrap."""
    from transformers import AutoConfig

    from megatron_bridge import ModelShape
    from slime_search.backends.megatron.model import ModelOptions

    hf_config = AutoConfig.from_pretrained(original)
    if args.num_layers is not None:  # ${MODEL_ARGS[@]} given: each flag must agree with config.json, as in training
        from slime_search.backends.megatron.model_args import check_against_hf_config, model_from_args

        check_against_hf_config(*model_from_args(args), hf_config)
    given = {
        name: getattr(args, name)
        for name in ("make_vocab_size_divisible_by", "max_position_embeddings")
        if getattr(args, name) is not None
    }
    return ModelShape.from_hf_config(hf_config), ModelOptions.from_hf_config(
        hf_config, attention_impl="packed", **given
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    from slime_search.backends.megatron.checkpoint import iteration_dir, latest_iteration
    from slime_search.backends.megatron.lora import read_lora_record

    iteration = args.iteration if args.iteration is not None else latest_iteration(args.load)
    if iteration is None:
        return fail(f"{args.load} is not a torch_dist checkpoint (no latest_checkpointed_iteration.txt)")
    try:
        lora, recorded = read_lora_record(iteration_dir(args.load, iteration))
    except FileNotFoundError as error:
        return fail(f"{error}; for a full checkpoint use tools/convert_torch_dist_to_hf.py")
    original = Path(args.hf_checkpoint or recorded["hf_checkpoint"])
    base_load = args.base_load or recorded["load"]
    if not (original / "config.json").is_file():
        return fail(f"{original} has no config.json: pass the base model's HF folder to --hf-checkpoint")
    if base_load is not None and latest_iteration(base_load) is None:
        return fail(f"the base's torch_dist folder {base_load} is missing or incomplete: pass it to --base-load")

    from megatron_bridge import megatron_to_hf
    from megatron_bridge.hf_io import read_hf_state, save_hf_folder
    from slime_search.backends.megatron.checkpoint import load_model
    from slime_search.backends.megatron.distributed import init_megatron, shutdown
    from slime_search.backends.megatron.lora import apply_lora, full_adapters, merged_state_dict
    from slime_search.backends.megatron.lora_peft import save_peft_adapter
    from slime_search.backends.megatron.model import build_gpt_model, load_hf_weights
    from slime_search.utils.net import free_port

    try:
        shape, options = model_as_trained(original, args)
    except ValueError as error:
        return fail(str(error))
    init_megatron(0, 1, tp_size=1, master_port=free_port())
    model = build_gpt_model(shape, options)
    if base_load is None:
        load_hf_weights(model, read_hf_state(str(original)), shape, options)
    else:
        load_model(model, base_load)
    apply_lora(model, lora)
    load_model(model, args.load, iteration)
    save_peft_adapter(args.save, full_adapters(model), shape, lora, str(original))
    if args.save_merged:
        hf_state = megatron_to_hf(merged_state_dict(model), shape, te_names=False)
        if shape.tie_word_embeddings:
            hf_state.pop("lm_head.weight")  # tied: transformers rebuilds it from the embeddings
        save_hf_folder(hf_state, original, Path(args.save_merged))
    shutdown()
    print(
        f"wrote {args.save}" + (f" and {args.save_merged}" if args.save_merged else "") + f" from iteration {iteration}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
