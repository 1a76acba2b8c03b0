"""An HF folder written bucket by bucket (--save-hf) loads as the model it came from; the run folder prunes the HF
copies with their checkpoints."""

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_bridge.hf_io import save_hf_shards
from slime_search.run_folder import RunFolder


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
