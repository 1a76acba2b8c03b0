"""The bytes of one checkpoint, how many a run keeps at once, and the refusal to start a run the --save disk cannot
hold. The checkpoint files themselves are weighed against `checkpoint_bytes` in tests/backends/test_megatron_train.py."""

import logging

import pytest

from slime_search.backends.megatron.checkpoint_size import CheckpointLayout, checkpoint_bytes, layout_of_shape
from slime_search.disk_budget import NotEnoughDisk, check_disk_budget, checkpoints_at_once, saves_in_run
from tests.backends.test_megatron_convert import parse as parse_model
from tests.test_arguments import parse


def test_checkpoint_bytes_count_the_model_once_and_the_optimizer_per_tensor_parallel_slice():
    # bf16: 10 parameters x 2 bytes, plus two slices of 6 x (4 fp32 main + 4 + 4 Adam moments) = 20 + 144
    assert checkpoint_bytes(CheckpointLayout(10, (6, 6), param_bytes=2)) == 164
    # fp32 steps its parameters directly: no main weights, 10 x 4 + 10 x 8
    assert checkpoint_bytes(CheckpointLayout(10, (10,), param_bytes=4)) == 120


def test_the_3b_recipe_checkpoint_at_tp2():
    from megatron_bridge import pad_vocab_size
    from megatron_bridge.param_count import count_parameters

    shape, options = parse_model("qwen2.5-3B")
    padded = pad_vocab_size(shape.vocab_size, options.make_vocab_size_divisible_by, 2)  # 151,936 -> 152,064
    layout = layout_of_shape(shape, padded, tp_size=2, param_bytes=2)
    total = count_parameters(shape, padded)
    replicated = shape.num_layers * 2 * shape.hidden_size + shape.hidden_size  # RMSNorm weights, on both slices
    assert layout.model_parameters == total
    assert layout.slice_parameters == ((total - replicated) // 2 + replicated,) * 2
    # the model in bf16 once, each slice's parameters in fp32 three times (main weights, two Adam moments)
    assert checkpoint_bytes(layout) == 2 * total + 12 * (total + replicated)
    assert round(checkpoint_bytes(layout) / 1e9, 1) == 43.2  # the figure examples/search-r1/README.md gives


def test_checkpoints_on_disk_at_once():
    # newest 2 + the one being written + 3 the guard may go back to + newest 2 set aside
    assert checkpoints_at_once(keep=2, guard=True, saves=81) == 10  # 2N + 4 + --max-rollbacks
    assert checkpoints_at_once(keep=2, guard=True, saves=81, max_rollbacks=3) == 11
    assert checkpoints_at_once(keep=2, guard=False, saves=81) == 3
    assert checkpoints_at_once(keep=2, guard=True, saves=81, evaluating_beside=True) == 12  # + 2 being evaluated
    assert checkpoints_at_once(keep=0, guard=True, saves=81) == 81  # every one is kept


def test_a_run_saves_its_start_every_interval_and_every_evaluated_version():
    from slime_search.run.config import run_config

    flags = ["--num-rollout", "1000", "--save-interval", "20", "--eval-interval", "25", "--eval-prompt-data", "nq", "e"]
    config = run_config(parse(*flags), vocab_size=100, use_gpu=False)
    # step 0; 50 multiples of 20 and 40 of 25 in 1..1000, 10 of them (multiples of 100) both
    assert saves_in_run(config) == 1 + 50 + 40 - 10


def _config(tmp_path, *flags):
    from slime_search.run.config import run_config

    return run_config(parse("--save", str(tmp_path / "run"), *flags), vocab_size=100, use_gpu=False)


def test_a_run_whose_disk_cannot_hold_its_checkpoints_is_refused_naming_the_flags(tmp_path):
    from slime_search.run.folder import RunFolder

    config = _config(tmp_path)
    run = RunFolder(config.run_dir)
    petabyte_model = CheckpointLayout(10**15, (10**15,), param_bytes=2)
    with pytest.raises(NotEnoughDisk) as refused:
        check_disk_budget(config, petabyte_model, run)
    message = str(refused.value)
    assert f"--save {tmp_path / 'run'}" in message and "--keep-checkpoints 2" in message
    assert "10 on disk at once" in message and "lower --keep-checkpoints" in message
    assert list(run.path.iterdir()) == []  # nothing written, nothing lost


def test_the_budget_is_logged_and_a_resumed_run_counts_the_checkpoints_it_has(tmp_path, caplog):
    from slime_search.run.folder import RunFolder

    config = _config(tmp_path, "--keep-checkpoints", "3")
    run = RunFolder(config.run_dir)
    for step in (0, 20):
        (run.checkpoints / f"iter_{step:07d}").mkdir(parents=True)
    (run.checkpoints / "undone" / "001-rollback" / "iter_0000040").mkdir(parents=True)
    layout = CheckpointLayout(1000, (1000,), param_bytes=4)  # 4,000 + 8,000 bytes
    with caplog.at_level(logging.INFO, logger="slime_search.disk_budget"):
        budget = check_disk_budget(config, layout, run)
    assert (budget.per_checkpoint, budget.count, budget.on_disk) == (12_000, 2 * 3 + 4 + 2, 3)
    assert budget.needed == 12_000 * (12 - 3)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "slime_search.disk_budget"]
    assert "up to 12 on disk at once (--keep-checkpoints 3)" in line and "free on the --save disk" in line
