"""The weight push benchmark at its smallest size: a one-layer model pushed once by each transport to a real CPU
engine, which must serve every pushed version (the benchmark checks each push)."""

import pytest

from benchmarks.perf.weight_push import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_each_transport_pushes_and_the_engine_serves_the_version(capsys):
    smallest = ["--hidden-size", "64", "--num-layers", "1", "--num-heads", "4", "--num-kv-heads", "2"]
    assert main([*smallest, "--intermediate-size", "128", "--repeats", "1", "--bucket-mb", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model: ") and "broadcast group set-up (once per run):" in out
    table = out.split("all pushes (s)\n")[1].splitlines()
    assert [line[:24].strip() for line in table] == ["disk", "nccl (gloo)", "tensor (shared memory)"]
    for line in table:
        seconds, bandwidth = (float(cell) for cell in line[24:].split()[:2])
        assert seconds > 0 and bandwidth > 0
