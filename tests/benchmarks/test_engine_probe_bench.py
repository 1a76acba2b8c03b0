"""The engine-probe benchmark at its smallest: bfloat16 against float32 on the tiny policy, within the probe's bound."""

import json

from benchmarks.perf import engine_probe
from slime_search.health.config import HealthConfig


def test_bfloat16_noise_of_the_tiny_policy_is_far_below_the_probes_bound(tiny_checkpoint, tmp_path, capsys):
    assert engine_probe.main(["--work", str(tmp_path), "--tiny", str(tiny_checkpoint)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == len(engine_probe.PROMPT + engine_probe.RESPONSE)
    assert 0 < out["bf16_vs_fp32_tiny_random"] < HealthConfig().max_logprob_gap / 10
