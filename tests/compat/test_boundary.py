"""The plugin boundary: which plugins get slime's samples, and how what a slime plugin returns becomes this project's
sample (loss mask, log-probs, statuses, versions) — and the reverse, for slime's reward after this project's
generate."""

from __future__ import annotations

import asyncio
from argparse import Namespace

import pytest

from slime_search.compat.boundary import adapt_plugins, slime_args, uses_slime
from slime_search.compat.samples import from_slime, token_versions
from slime_search.types import Sample, Status, TrainSample


class Characters:
    """A stand-in tokenizer for the segments' text: one character per token id."""

    @staticmethod
    def decode(ids):
        return "".join(chr(ord("a") + i) for i in ids)


def slime_sample(slime_api, **fields):
    return slime_api.types.Sample(**{"tokens": [9, 9, 0, 1, 2, 3], "response_length": 4, **fields})


def test_only_plugins_whose_module_uses_slime_are_wrapped(slime_api):
    from slime_search.search_r1 import generate as ours

    scope = {"Sample": slime_api.types.Sample}
    exec("async def theirs(args, sample, params):\n    return sample\n", scope)
    assert uses_slime(scope["theirs"]) and not uses_slime(ours.generate)
    end = ours.close_resources
    assert adapt_plugins(ours.generate, ours.generate, end) == (ours.generate, ours.generate, end)
    generate, reward, end_rollout = adapt_plugins(scope["theirs"], ours.generate, end)
    assert generate is not scope["theirs"] and reward is ours.generate and end_rollout is not end


def test_what_a_slime_plugin_returns_becomes_the_trainers_sample(slime_api):
    original = Sample(prompt=[{"role": "user", "content": "q"}], group_index=3, index=7, metadata={"row": 5})
    view = slime_sample(
        slime_api,
        loss_mask=[1, 1, 0, 1],
        rollout_log_probs=[-0.1, -0.2, 0.0, -0.3],
        weight_versions=["4", "5"],
        status=slime_api.types.Sample.Status.TRUNCATED,
        metadata={"plugin": True},
        response="abcd",
    )
    sample = from_slime(view, original, Characters(), "p.generate")
    assert (sample.group_index, sample.index, sample.prompt) == (3, 7, original.prompt)  # the project's own
    assert sample.status is Status.TRUNCATED and sample.metadata == {"row": 5, "plugin": True}
    assert sample.token_versions == [4, 4, -1, 5]  # one version per model turn
    assert sample.segments == [("ab", True), ("c", False), ("d", True)] and sample.slime_sample is view
    train = TrainSample.from_sample(sample)
    assert (train.tokens, train.response_length, train.loss_mask) == ([9, 9, 0, 1, 2, 3], 4, [1, 1, 0, 1])
    assert train.rollout_log_probs == [-0.1, -0.2, 0.0, -0.3]

    whole = from_slime(slime_sample(slime_api, rollout_log_probs=[0.0] * 4), original, Characters(), "p")
    assert whole.loss_mask == [1, 1, 1, 1]  # slime trains a response without a mask whole
    removed = from_slime(
        slime_sample(slime_api, rollout_log_probs=[0.0] * 4, remove_sample=True), original, Characters(), "p"
    )
    assert removed.loss_mask == [0, 0, 0, 0]
    pending = from_slime(slime_sample(slime_api, rollout_log_probs=[0.0] * 4), original, Characters(), "p")
    assert pending.status is Status.FAILED and pending.metadata["finish_reason"] == "plugin_pending"
    aborted = from_slime(slime_sample(slime_api, status=Status.ABORTED), original, Characters(), "p")
    assert aborted.status is Status.ABORTED and aborted.rollout_log_probs == [0.0] * 4  # out of the loss anyway
    with pytest.raises(ValueError, match="p.generate returned a sample without rollout_log_probs"):
        from_slime(slime_sample(slime_api, status=Status.COMPLETED), original, Characters(), "p.generate")
    with pytest.raises(ValueError, match="loss_mask of 2 entries for a response of 4 tokens"):
        from_slime(slime_sample(slime_api, loss_mask=[1, 1], rollout_log_probs=[0.0] * 4), original, Characters(), "p")


def test_token_versions_from_slimes_weight_versions():
    assert token_versions([1, 1, 0, 1], ["3"]) == [3, 3, -1, 3]  # one version for the whole trajectory
    assert token_versions([1, 0, 1, 0, 1], ["1", "2"]) == [-1, -1, -1, -1, -1]  # recorded some other way: unknown
    assert token_versions([1, 1], ["demonstrator"]) == [-1, -1]  # not a number


def test_slimes_reward_after_this_projects_generate_sees_a_slime_sample(slime_api, tiny_checkpoint):
    seen = []
    scope = {"Sample": slime_api.types.Sample, "seen": seen}
    exec(
        "async def reward(args, sample, **kw):\n"
        "    assert isinstance(sample, Sample)\n"
        "    seen.append(sample)\n"
        "    return 0.5\n",
        scope,
    )
    _, reward, _ = adapt_plugins(lambda *a: None, scope["reward"], lambda: None)
    args = Namespace(hf_checkpoint=str(tiny_checkpoint), apply_chat_template=True, engine_url="http://127.0.0.1:9")
    ours = Sample(prompt=[{"role": "user", "content": "hi"}], label={"ground_truth": {"target": ["x"]}}, index=1)
    ours.tokens = [1, 2]
    ours.append_response_tokens([3], generated=True, log_probs=[-0.5], text="c")
    misc, rollout = slime_api.misc, slime_api.sglang_rollout
    misc.SingletonMeta._instances.pop(rollout.GenerateState, None)
    try:
        assert asyncio.run(reward(args, ours)) == 0.5
    finally:
        misc.SingletonMeta._instances.pop(rollout.GenerateState, None)
    view = seen[0]
    assert view.prompt.startswith("<|im_start|>") and view.prompt.endswith("<|im_start|>assistant\n")
    assert (view.tokens, view.loss_mask, view.rollout_log_probs, view.response) == ([1, 2, 3], [1], [-0.5], "c")
    assert view.label == ours.label and view.session_id

    converted = slime_args(args)  # slime's names of the engines' address and slime's defaults
    assert (converted.sglang_router_ip, converted.sglang_router_port, converted.partial_rollout) == (
        "127.0.0.1",
        9,
        False,
    )
