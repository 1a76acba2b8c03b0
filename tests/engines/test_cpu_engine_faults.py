"""The CPU engine's injected faults, which the health benchmarks use: a stale engine that acknowledges weight updates
without loading them, and a slow decoder."""

import pytest
import torch

from slime_search.engines import cpu_engine
from slime_search.engines.cpu_engine import CpuEngine, GenerationRequest, InjectedFaults
from slime_search.engines.sampling import SamplingParams
from slime_search.models.tiny_qwen import TinyQwenConfig, save_tiny_checkpoint


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory):
    """The tiny architecture with other random weights."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("other"), TinyQwenConfig(seed=123))


def logits(engine):
    with torch.no_grad():
        return engine.model(torch.tensor([[1, 2, 3]])).logits


def test_a_frozen_engine_names_the_new_version_but_serves_its_old_weights(tiny_checkpoint, other_checkpoint):
    engine = CpuEngine(tiny_checkpoint, weight_version="0", faults=InjectedFaults(freeze_weights_after=1))
    before = logits(engine)
    assert engine.update_weights_from_disk(str(other_checkpoint), "1") == "1"
    moved = logits(engine)
    assert not torch.equal(moved, before)  # up to version 1 the updates load
    assert engine.update_weights_from_disk(str(tiny_checkpoint), "2") == "2"
    assert engine.weight_version == "2" and torch.equal(logits(engine), moved)  # version 2 is claimed, not served
    healthy = CpuEngine(tiny_checkpoint, weight_version="0")
    healthy.update_weights_from_disk(str(other_checkpoint), "2")
    assert torch.equal(logits(healthy), moved)


def test_a_slow_engine_sleeps_in_every_decode_step(tiny_checkpoint, monkeypatch):
    slept = []
    monkeypatch.setattr(cpu_engine.time, "sleep", slept.append)
    engine = CpuEngine(tiny_checkpoint, faults=InjectedFaults(decode_delay_s=0.25))
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    [result] = engine.generate([GenerationRequest([1, 2, 3], params, rid="a")])
    assert len(result.output_ids) == 4 and slept == [0.25] * 3  # the first token comes from the prefill
    monkeypatch.setattr(cpu_engine.time, "sleep", lambda s: pytest.fail("a healthy engine never sleeps"))
    CpuEngine(tiny_checkpoint).generate([GenerationRequest([1, 2, 3], params, rid="b")])
