"""`python -m tools.gpu_check --cpu`: the GPU kit's parts on the tiny model on CPU, so the kit cannot rot before
the next GPU machine runs it; and the plan a GPU runs, within its six minutes."""

import json
import math
import subprocess
import sys

import pytest
import torch

from tests.tools.test_gpu_check_wheels import SCRIPT, listed_packages, not_carried
from tools.gpu_check.ipc import flatten_bucket, unflatten_bucket
from tools.gpu_check.kit import PARTS, imported_distributions, plan, run_part
from tools.gpu_check.report import _short_error, markdown
from tools.gpu_check.shared import fingerprint, recipe_on_one_device


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_kit_runs_every_part_on_cpu_and_writes_its_tables(tmp_path):
    out = tmp_path / "kit"
    done = subprocess.run(
        [sys.executable, "-m", "tools.gpu_check", "--cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    report = json.loads((out / "gpu_kit.json").read_text())
    parts = {p["part"]: p for p in report["parts"]}
    assert {name: p["returncode"] for name, p in parts.items()} == {name: 0 for name, _, _ in PARTS}, done.stdout[
        -3000:
    ]
    assert done.returncode == 0

    # checks: the actor against HF on the device, every check ran, none failed
    checks = {r["check"]: r for r in parts["checks"]["records"]}
    assert {"environment", "parity", "log_probs", "train", "gather", "attention"} <= checks.keys()
    assert not [r for r in parts["checks"]["records"] if "error" in r]
    assert checks["parity"]["max_abs_logit_diff"] < 1e-4 and checks["log_probs"]["max_abs_diff_vs_hf"] < 1e-4

    # recipe_step: the recipe's own flags (9,216 tokens, full recompute, KL reference, Megatron's plain optimizer)
    (recipe,) = parts["recipe_step"]["records"]
    assert (recipe["max_tokens_per_gpu"], recipe["recompute"], recipe["kl"]) == (
        9216,
        "full/uniform/1",
        "low_var_kl 0.001",
    )
    assert (recipe["attention_impl"], recipe["distributed_optimizer"]) == ("packed", False)
    assert any("--sequence-parallel off" in change for change in recipe["changed_for_one_device"])
    assert len(recipe["steps"]) == 2 and all(s["step_applied"] == 1.0 for s in recipe["steps"])
    assert all(s["old_log_probs_s"] > 0 and s["ref_log_probs_s"] > 0 and s["train_step_s"] > 0 for s in recipe["steps"])
    assert all(math.isfinite(s["loss"]) and "kl_loss" in s for s in recipe["steps"])

    # handover: twice, the actor and its reference come back byte for byte, and the next step is applied
    (handover,) = parts["handover"]["records"]
    assert len(handover["rounds"]) == 2 and handover["tensors_fingerprinted"]["optimizer"] > 0
    assert all(all(t["bit_exact"].values()) and t["gib_handed"] > 0 for t in handover["rounds"])
    assert set(handover["rounds"][0]["bit_exact"]) == {"params", "optimizer", "reference"}
    assert handover["step_after"]["step_applied"] == 1.0

    # gather: both passes send every parameter once, in several buckets
    (gather,) = parts["gather"]["records"]
    assert gather["every_parameter_sent"] and [p["flattened"] for p in gather["passes"]] == [False, True]
    assert all(p["buckets"] > 2 for p in gather["passes"])

    # ipc: three pushes over shared memory, every bucket read as sent, the consumer's copy equal to the weights
    summary = parts["ipc"]["records"][-1]
    assert summary["transport"] == "shared memory (file_system)" and len(summary["pushes"]) == 3
    assert summary["consumer_weights_equal"] is True
    assert all(p["buckets"] > 2 and p["buckets_read_wrong"] == [] for p in summary["pushes"])

    # checkpoint: the resumed actor is the saved one, and its second step the continued one's, bit for bit
    (checkpoint,) = parts["checkpoint"]["records"]
    assert checkpoint["weights_and_optimizer_equal_after_load"] and checkpoint["second_step_bit_identical"]
    assert checkpoint["iteration_loaded"] == 1 and checkpoint["checkpoint_bytes"] > checkpoint["converted_bytes"]

    # what the parts imported is carried by scripts/gpu_kit_wheels.sh or already on the GPU machine
    imported = {name: p["distributions"] for name, p in parts.items()}
    assert all("megatron-core" in imported[name] for name in ("checks", "recipe_step", "checkpoint"))
    assert not_carried(imported, listed_packages(SCRIPT.read_text())) == {}

    table = (out / "gpu_kit.md").read_text()
    for heading in ("## checks", "## recipe_step", "## handover", "## gather", "## ipc", "## checkpoint"):
        assert heading in table


def test_on_a_gpu_every_part_has_a_process_of_its_own_within_six_minutes():
    planned = plan(cpu=False, skip=set())
    assert [(name, argv[0]) for name, argv, _ in planned] == [
        ("checks", "tools.gpu_check.megatron_checks"),
        ("recipe_step", "tools.gpu_check.recipe"),
        ("handover", "tools.gpu_check.handover"),
        ("gather", "tools.gpu_check.gather"),
        ("ipc", "tools.gpu_check.ipc"),
        ("checkpoint", "tools.gpu_check.checkpoint"),
    ]
    assert sum(limit for _, _, limit in planned) <= 360  # two runs and two machine starts fit a 15-minute lease
    assert all(argv[1:] == [] for _, argv, _ in planned)
    on_cpu = plan(cpu=True, skip=set())
    assert all(argv[1:] == ["--cpu"] for name, argv, _ in on_cpu if name != "checks")
    with pytest.raises(SystemExit, match="unknown parts \\['loop'\\]"):
        plan(cpu=False, skip={"loop"})


def test_the_3b_parts_train_what_the_recipe_script_sets_at_tp_1():
    """Read from `DRY_RUN=1 bash examples/search-r1/run_qwen2.5_3B.sh`, not restated: a change to the recipe is a
    change to what the kit measures."""
    recipe = recipe_on_one_device("qwen2.5-3B", cpu=False)
    assert (recipe.shape.num_layers, recipe.shape.hidden_size, recipe.shape.vocab_size) == (36, 2048, 151936)
    assert recipe.options.params_dtype == torch.bfloat16 and not recipe.options.sequence_parallel
    assert (recipe.options.recompute_granularity, recipe.options.recompute_num_layers) == ("full", 1)
    assert recipe.actor.max_tokens_per_micro_batch == 9216 and not recipe.actor.optim.use_distributed_optimizer
    assert recipe.with_reference and recipe.actor.loss.kl_coef == 0.001 and recipe.bucket_bytes == 512 * 2**20
    assert recipe.changed == (
        "--tensor-model-parallel-size 2 -> 1 (one device)",
        "--sequence-parallel off (Megatron refuses it at TP 1)",
    )
    faithful = recipe_on_one_device("qwen2.5-3B", cpu=False, env={"RECIPE": "search-r1"})
    assert (faithful.actor.optim.adam_beta2, faithful.actor.loss.reduction) == (0.999, "token_mean")
    tiny = recipe_on_one_device("tiny-qwen2", cpu=True)
    assert tiny.shape.hidden_size == 64 and tiny.options.params_dtype == torch.float32
    assert tiny.changed[-1] == "--bf16 off (bf16 trains on GPU only)"


def test_a_fingerprint_tells_every_change_of_bytes_apart(monkeypatch):
    """Equal bytes give equal fingerprints; a zeroed, swapped, shifted or one-bit-flipped tensor does not, also when the
    words are read in several chunks."""
    import tools.gpu_check.shared as shared

    monkeypatch.setattr(shared, "CHUNK", 7)
    tensor = torch.randn(10, 5).to(torch.bfloat16)
    assert fingerprint(tensor) == fingerprint(tensor.clone())
    flipped = tensor.clone()
    flipped.view(torch.int16)[3, 2] ^= 1
    swapped = tensor.clone()
    swapped[[0, 1]] = tensor[[1, 0]]
    changed = [torch.zeros_like(tensor), swapped, tensor.roll(1), flipped]
    assert len({fingerprint(t) for t in [tensor, *changed]}) == 5
    assert fingerprint(torch.arange(3, dtype=torch.uint8)) != fingerprint(torch.tensor([2, 1, 0], dtype=torch.uint8))


def test_a_flattened_bucket_holds_its_tensors_end_to_end_and_gives_them_back():
    named = [
        ("a", torch.randn(3, 4)),
        ("b", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
        ("c", torch.ones(5).half()),
    ]
    flat, metadata = flatten_bucket(named)
    assert flat.dtype == torch.uint8 and flat.numel() == 3 * 4 * 4 + 6 * 8 + 5 * 2
    assert [(start, end) for *_, start, end in metadata] == [(0, 48), (48, 96), (96, 106)]
    back = unflatten_bucket(flat, metadata)
    assert [name for name, _ in back] == ["a", "b", "c"]
    assert all(torch.equal(t, u) and t.dtype == u.dtype for (_, t), (_, u) in zip(named, back, strict=True))


def test_a_part_that_fails_or_overruns_is_recorded_not_raised():
    missing = run_part("missing", ["benchmarks.no_such_module"], timeout_s=60)
    assert missing["returncode"] == 1 and missing["records"] == []
    assert "No module named benchmarks.no_such_module" in missing["log_tail"]
    assert "import time:" not in missing["log_tail"]  # the import lines are read, not shown
    overrun = run_part("overrun", ["tools.gpu_check.recipe", "--cpu"], timeout_s=1)
    assert overrun["returncode"] == "timeout" and overrun["seconds"] < 30
    helped = run_part("help", ["tools.gpu_check.step", "--help"], timeout_s=60)
    assert helped["returncode"] == 0 and helped["log_tail"] == ""


def test_a_kit_run_without_its_checks_still_names_the_device_it_measured(tmp_path):
    """A rerun of some parts alone (`--skip checks,...`) used to print "GPU kit: ?": the device and the software came
    only from the checks' records. A short environment part takes their place."""
    rest = ",".join(name for name, _, _ in PARTS)
    assert [name for name, _, _ in plan(cpu=True, skip={"checks", "ipc"})][:2] == ["environment", "recipe_step"]
    done = subprocess.run(
        [sys.executable, "-m", "tools.gpu_check", "--cpu", "--skip", rest, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_kit.json").read_text())
    assert [p["part"] for p in report["parts"]] == ["environment"]
    assert report["environment"]["device"] == "cpu" and report["environment"]["torch"]
    assert (tmp_path / "gpu_kit.md").read_text().startswith("# GPU kit: cpu\n")


def test_a_part_that_ran_out_of_memory_is_a_row_of_the_report_with_what_it_asked():
    error = "out of memory: CUDA out of memory. Tried to allocate 584.00 MiB. GPU 0 has a total capacity of 79.19 GiB"
    assert _short_error(error) == "out of memory (584.00 MiB asked)"
    assert _short_error("not run: no CUDA GPU") == "not run: no CUDA GPU"
    summary = {"model": "qwen2.5-3B", "changed_for_one_device": [], "error": error}
    peaks = {"peak_allocated_gib": 78.1, "peak_reserved_gib": 78.9, "device_total_gib": 79.19}
    parts = [
        {"part": name, "returncode": 0, "seconds": 1.0, "records": [{**summary, **peaks}], "log_tail": ""}
        for name in ("recipe_step", "handover", "gather")
    ]
    table = markdown({"command": "kit", "seconds": 3.0, "environment": {"device": "H100"}, "parts": parts})
    assert (
        table.count("**out of memory (584.00 MiB asked)**") == 3 and "78.1 allocated / 78.9 reserved of 79.19" in table
    )


@pytest.mark.slow
def test_the_recipes_full_recompute_changes_the_steps_memory_not_its_result():
    """`tools.gpu_check.step --recompute` sizes the step as the 3B recipe runs it (full, uniform, one layer): the
    same first loss and gradient norm as without it, from the same weights."""

    def first_step(*flags):
        done = subprocess.run(
            [sys.executable, "-m", "tools.gpu_check.step", "--attention-impl", "packed", "--cpu", "--budgets", "128"]
            + list(flags),
            capture_output=True,
            text=True,
            timeout=240,
            check=True,
        )
        (record,) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        return record

    plain, recomputed = first_step(), first_step("--recompute")
    assert (plain["recompute"], recomputed["recompute"]) == (None, "full")
    assert recomputed["first_step"]["loss"] == pytest.approx(plain["first_step"]["loss"], rel=1e-6, abs=1e-8)
    assert recomputed["first_step"]["grad_norm"] == pytest.approx(plain["first_step"]["grad_norm"], rel=1e-6)


def test_a_namespace_module_counts_only_the_distribution_that_ships_it():
    """`google` is protobuf's and googleapis-common-protos' (and, where ray[default] is installed, google-auth's):
    importing google.protobuf must not count the others as needed on the GPU machine."""
    import importlib.metadata

    owners = importlib.metadata.packages_distributions().get("google", [])
    if len(owners) < 2:
        pytest.skip(f"`google` has one distribution here ({owners}): no namespace to tell apart")
    found = imported_distributions("import time:       120 |        340 |   google.protobuf\n")
    assert found == {"protobuf": importlib.metadata.version("protobuf")}
    # a compiled module of the namespace (protobuf's google/_upb/_message.abi3.so) counts too
    assert imported_distributions("import time: 1 | 1 | google._upb._message\n").keys() == {"protobuf"}
    assert imported_distributions("import time: 1 | 1 | torch\nnot an import line | google\n").keys() == {"torch"}
