"""An HF folder written bucket by bucket (--save-hf) loads as the model it came from; the run folder prunes the HF
copies with their checkpoints."""

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_bridge.hf_io import copy_hf_files, read_hf_state, save_hf_shards
from megatron_bridge.qwen import ModelShape, hf_to_megatron
from slime_search.run.folder import RunFolder


def test_buckets_become_shards_and_an_index_that_from_pretrained_reads(tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    state = load_file(tiny_checkpoint / "model.safetensors")
    items = sorted(state.items())
    buckets = (items[i : i + 5] for i in range(0, len(items), 5))  # consumed once, as a stream
    out = save_hf_shards(buckets, tiny_checkpoint, tmp_path / "hf")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == -(-len(items) // 5) and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(index["weight_map"]) == sorted(state)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    assert not list(out.glob("*.part")) and (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    original = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).state_dict()
    assert loaded.keys() == original.keys() and all(torch.equal(loaded[k], original[k]) for k in original)


def test_one_bucket_is_one_file_and_no_weights_is_an_error(tiny_checkpoint, tmp_path):
    state = load_file(tiny_checkpoint / "model.safetensors")
    out = save_hf_shards([list(state.items())], tiny_checkpoint, tmp_path / "one")
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    assert load_file(out / "model.safetensors").keys() == state.keys()
    with pytest.raises(ValueError, match="no weights"):
        save_hf_shards([[]], tiny_checkpoint, tmp_path / "none")


def _megatron_state(hf_state, checkpoint):
    from transformers import AutoConfig

    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(checkpoint))
    return {k: v.float() for k, v in hf_to_megatron(hf_state, shape, padded_vocab=shape.vocab_size + 64).items()}


@pytest.mark.parametrize("layout", ["one file", "shards", "bf16 shards", "bin"])
def test_the_weights_read_without_a_model_are_those_from_pretrained_gives_megatron(tiny_checkpoint, tmp_path, layout):
    """What the ranks load a policy with: every tensor Megatron takes equals the one from the HF model that
    `from_pretrained` builds (the ranks no longer build it), from one file, shards with their index, shards stored in
    bf16 (read in bf16, equal once cast as Megatron's copy casts), or a folder with only `pytorch_model.bin`."""
    from transformers import AutoModelForCausalLM

    folder = tiny_checkpoint
    state = load_file(tiny_checkpoint / "model.safetensors")
    if layout != "one file":
        dtype = torch.bfloat16 if layout == "bf16 shards" else torch.float32
        items = sorted((k, v.to(dtype)) for k, v in state.items())
        folder = save_hf_shards((items[i : i + 7] for i in range(0, len(items), 7)), tiny_checkpoint, tmp_path / "hf")
    if layout == "bin":
        folder = tmp_path / "bin"
        folder.mkdir()
        copy_hf_files(tiny_checkpoint, folder)
        torch.save(state, folder / "pytorch_model.bin")
        assert not list(folder.glob("*.safetensors")) and list(folder.glob("*.bin"))
    read = read_hf_state(folder)
    expected = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    if layout == "bf16 shards":
        assert {t.dtype for t in read.values()} == {torch.bfloat16}
    mine, theirs = _megatron_state(read, tiny_checkpoint), _megatron_state(expected, tiny_checkpoint)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_hf_copies_go_with_their_checkpoints(tmp_path):
    run = RunFolder(tmp_path)
    for step in (0, 2, 3):  # complete checkpoints: their folders and the tracker
        (run.checkpoints / f"iter_{step:07d}").mkdir(parents=True)
    (run.checkpoints / "latest_checkpointed_iteration.txt").write_text("3")
    for step in (0, 1, 2, 3):
        run.hf_folder(step).mkdir(parents=True)
    (tmp_path / "hf" / "step_4.partial").mkdir()  # a write cut off
    assert run.checkpoint_steps() == [0, 2, 3]
    assert run.prune_hf_folders() == [1, -1]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["step_0", "step_2", "step_3"]
