"""The overhead benchmark's batch has the miniature's shape and an observation span out of the loss."""

from benchmarks.perf.health_overhead import batch


def test_the_batch_mixes_advantages_and_masks_an_observation():
    samples = batch(samples=12, prompt=5, response=12, vocab=50)
    assert len(samples) == 12 and all(len(s.tokens) == 17 and s.response_length == 12 for s in samples)
    assert samples[0].loss_mask == [1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1]
    assert samples[0].token_versions == [0, 0, 0, 0, -1, -1, 0, 0, 0, 0, 0, 0]
    assert {s.advantage for s in samples} == {-1.0, 0.0, 1.0}
    assert samples == batch(samples=12, prompt=5, response=12, vocab=50)  # seeded
