"""The LoRA bytes benchmark at its smallest size: the tiny shape at TP 1, built on the meta device."""

import pytest

from benchmarks.harness.baselines import check_baselines
from benchmarks.perf.lora_bytes import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_lora_trains_a_sliver_and_pushes_the_same_folded_model(capsys):
    assert main(["--shape", "tiny", "--tp", "1", "--rank", "4", "--fp32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    columns = lines[0].split(": ")[1].split()
    rows = {line.split()[0]: dict(zip(columns, map(float, line.split()[1:]), strict=True)) for line in lines[1:]}
    full, lora = rows["full"], rows["lora4"]
    assert 0 < lora["trained"] < 0.01 * full["trained"]
    assert lora["optimizer_gib"] < 0.01 * full["optimizer_gib"] and lora["checkpoint_gb"] < full["checkpoint_gb"]
    assert (
        lora["push_merged_gb"] == full["push_merged_gb"]
        and 0 < lora["push_adapters_gb"] < 0.01 * full["push_merged_gb"]
    )
    # under PEFT's names a fused projection's A goes once per HF projection: more than the trained parameters
    assert lora["push_adapters_gb"] > lora["trained"] * 4 / 1e9
    figures = {f"{row}/{column}": value for row, values in rows.items() for column, value in values.items()}
    check_baselines("lora_bytes --shape tiny --tp 1 --rank 4 --fp32", figures)
