"""`python -m benchmarks.gpu_kit --cpu`: the GPU kit's three parts on the tiny model on CPU, so the kit cannot rot
before the next GPU machine runs it."""

import json
import subprocess
import sys

import pytest

from benchmarks.gpu_kit import _short_error, plan, run_part, run_plan


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_kit_runs_every_part_on_cpu_and_writes_its_tables(tmp_path):
    out = tmp_path / "kit"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_kit", "--cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    report = json.loads((out / "gpu_kit.json").read_text())
    parts = {p["part"]: p for p in report["parts"]}
    assert {name: p["returncode"] for name, p in parts.items()} == dict.fromkeys(
        ("checks", "step_packed", "step_local", "loop"), 0
    ), done.stdout[-3000:]
    assert done.returncode == 0

    # (a) the actor against HF on the device: every check ran, none failed
    checks = {r["check"]: r for r in parts["checks"]["records"]}
    assert {"environment", "parity", "log_probs", "train", "gather", "attention"} <= checks.keys()
    assert not [r for r in parts["checks"]["records"] if "error" in r]
    assert checks["parity"]["max_abs_logit_diff"] < 1e-4 and checks["log_probs"]["max_abs_diff_vs_hf"] < 1e-4
    attention = checks["attention"]  # the packed attention against the local one, fp32
    assert max(attention[k] for k in ("max_abs_logit_diff", "max_abs_log_prob_diff", "max_abs_grad_diff")) < 1e-5

    # (b) both attentions at the three budgets, from the same weights: the same first step
    steps = [r for name in ("step_packed", "step_local") for r in parts[name]["records"]]
    assert [(r["attention_impl"], r["tokens_per_micro_batch"]) for r in steps] == [
        (impl, budget) for impl in ("packed", "local") for budget in (64, 128, 256)
    ]
    assert all(r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["peak_memory_gib"] > 0 for r in steps)
    packed_first, local_first = steps[0]["first_step"], steps[3]["first_step"]
    assert packed_first["loss"] == pytest.approx(local_first["loss"], rel=1e-5, abs=1e-7)
    assert packed_first["grad_norm"] == pytest.approx(local_first["grad_norm"], rel=1e-5)

    # (c) the loop: each push served, each rollout sampled by the previous push, trainer and engine agree
    loop = parts["loop"]["records"]
    assert [r["weight_version"] for r in loop] == ["1", "2", "3"]
    assert [r["rollout/weight_version"] for r in loop] == [["0"], ["1"], ["2"]]
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-4 for r in loop)
    assert all(r["time/sync_s"] > 0 for r in loop)

    table = (out / "gpu_kit.md").read_text()
    for heading in ("(a) the actor against Hugging Face", "(b) a train step", "(c) the loop"):
        assert heading in table


def test_the_kit_runs_its_step_and_loop_modules_as_its_parts():
    modules = {name: argv[0] for name, argv, _ in plan(cpu=True, budgets=None, skip=set())}
    assert modules == {
        "checks": "benchmarks.megatron_gpu_checks",
        "step_packed": "benchmarks.gpu_kit_step",
        "step_local": "benchmarks.gpu_kit_step",
        "loop": "benchmarks.gpu_kit_loop",
    }


def test_on_cuda_each_step_budget_has_a_process_of_its_own():
    """Run one after another in one process, a budget inherited the allocator's layout of the one before: on an H200
    the local attention at 4,096 tokens ran out of memory after 2,048, and fit alone."""
    steps = [(name, argv) for name, argv, _ in plan(cpu=False, budgets=None, skip=set()) if name.startswith("step_")]
    assert [name for name, _ in steps] == [f"step_{i}_{b}" for i in ("packed", "local") for b in (2048, 4096, 8192)]
    assert all(argv[-2:] == ["--budgets", name.split("_")[2]] for name, argv in steps)
    limits = sum(limit for _, _, limit in plan(cpu=False, budgets=None, skip=set()))
    assert limits < 600  # the whole kit fits one ten-minute command


def test_an_attention_out_of_memory_at_one_budget_is_not_tried_at_larger_ones():
    ran = []

    def runner(name, argv, timeout_s):
        ran.append(name)
        error = {"error": "out of memory: CUDA out of memory"} if name == "step_local_4096" else {}
        return {"part": name, "returncode": 0, "records": [error]}

    parts = run_plan(plan(cpu=False, budgets=None, skip={"checks", "loop", "environment"}), runner=runner)
    assert ran == [
        "environment",
        *(f"step_packed_{b}" for b in (2048, 4096, 8192)),
        "step_local_2048",
        "step_local_4096",
    ]
    skipped = parts[-1]
    assert skipped["part"] == "step_local_8192" and skipped["records"][0]["tokens_per_micro_batch"] == 8192
    assert skipped["records"][0]["error"].startswith("not run")


def test_a_part_that_fails_or_overruns_is_recorded_not_raised():
    missing = run_part("missing", ["benchmarks.no_such_module"], timeout_s=60)
    assert missing["returncode"] == 1 and missing["records"] == []
    assert "No module named benchmarks.no_such_module" in missing["log_tail"]
    overrun = run_part("overrun", ["benchmarks.gpu_kit_step", "--attention-impl", "packed", "--cpu"], timeout_s=1)
    assert overrun["returncode"] == "timeout" and overrun["seconds"] < 30
    helped = run_part("help", ["benchmarks.gpu_kit_step", "--help"], timeout_s=60)
    assert helped["returncode"] == 0 and helped["log_tail"] == ""


def test_a_kit_run_without_its_checks_still_names_the_device_it_measured(tmp_path):
    """A rerun of the steps and the loop alone (`--skip checks`) used to print "GPU kit: ?": the device and the
    software came only from the checks' records. A short environment part takes their place."""
    names = [name for name, _, _ in plan(cpu=True, budgets=None, skip={"checks", "step"})]
    assert names == ["environment", "loop"]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_kit", "--cpu", "--skip", "checks,step,loop", "--out", str(tmp_path)],
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


def test_an_out_of_memory_cell_keeps_what_was_asked_with_its_unit():
    error = "out of memory: CUDA out of memory. Tried to allocate 584.00 MiB. GPU 0 has a total capacity of 79.19 GiB"
    assert _short_error(error) == "out of memory (584.00 MiB asked)"
    assert _short_error("not run: a smaller budget ran out of memory") == "not run: a smaller budget ran out of memory"


@pytest.mark.slow
def test_the_recipes_full_recompute_changes_the_steps_memory_not_its_result():
    """`--recompute` sizes the step as the 3B recipe runs it (full, uniform, one layer): the same first loss and
    gradient norm as without it, from the same weights."""

    def first_step(*flags):
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.gpu_kit_step", "--attention-impl", "packed", "--cpu", "--budgets", "128"]
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
