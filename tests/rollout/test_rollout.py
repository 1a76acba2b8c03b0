"""Rollout data source, groups, zero-variance filtering with over-sampling, advantages and the DP split."""

import asyncio
import random

import pytest

from slime_search.ray.train_group import split_for_data_parallel
from slime_search.rollout.data_source import DataConfig, DataSource
from slime_search.rollout.rollout import RolloutConfig, assign_advantages, generate_rollout
from slime_search.search_r1.config import search_r1_args
from slime_search.search_r1.prompt import make_row
from slime_search.search_r1.reward import reward_func
from slime_search.types import Sample, Status

ROWS = [make_row({"question": f"q{i}", "golden_answers": [f"a{i}"]}, "nq", "train", i) for i in range(10)]


def test_seeded_order_is_reproducible_and_leaves_global_rng_alone():
    random.seed(1)
    before = random.random()
    random.seed(1)
    source = DataSource(DataConfig(path="mem", shuffle=True, seed=3), rows=ROWS)
    first = [p.index for p in source.take(10)]
    assert random.random() == before  # no global RNG was consumed
    assert sorted(first) == list(range(10)) and first != list(range(10))
    second_epoch = [p.index for p in source.take(10)]
    assert sorted(second_epoch) == list(range(10)) and second_epoch != first
    again = DataSource(DataConfig(path="mem", shuffle=True, seed=3), rows=ROWS)
    assert [p.index for p in again.take(10)] == first


def test_resume_continues_where_it_stopped_across_epochs():
    source = DataSource(DataConfig(path="mem", shuffle=True, seed=5), rows=ROWS)
    source.take(7)
    state = source.state_dict()
    expected = [p.index for p in source.take(8)]  # wraps into epoch 1
    resumed = DataSource(DataConfig(path="mem", shuffle=True, seed=5), rows=ROWS)
    resumed.load_state_dict(state)
    assert [p.index for p in resumed.take(8)] == expected
    item = resumed.item(3)
    assert item.label == {"style": "rule", "ground_truth": {"target": ["a3"]}} and item.metadata["data_source"] == "nq"


def test_prompts_given_back_at_a_checkpoint_are_served_first_after_the_resume():
    """A checkpoint taken while rollouts are in flight gives their prompts back: the resumed run takes exactly the
    prompts the interrupted one had not trained on, those first, and then goes on where it stopped."""
    source = DataSource(DataConfig(path="mem", shuffle=True, seed=5), rows=ROWS)
    trained = [p.index for p in source.take(3)]
    in_flight = [p.index for p in source.take(4)]  # taken, not trained on when the checkpoint is written
    state = source.state_dict(given_back=in_flight)
    later = [p.index for p in source.take(5)]
    resumed = DataSource(DataConfig(path="mem", shuffle=True, seed=5), rows=ROWS)
    resumed.load_state_dict(state)
    again = [p.index for p in resumed.take(9)]
    assert again == in_flight + later and not set(again[:4]) & set(trained)
    assert resumed.state_dict()["given_back"] == []
    old = DataSource(DataConfig(path="mem", shuffle=True, seed=5), rows=ROWS)
    old.load_state_dict({"epoch": 0, "offset": 3})  # a checkpoint from before prompts were given back
    assert [p.index for p in old.take(4)] == in_flight


def test_missing_keys_name_the_flags():
    with pytest.raises(KeyError, match="--input-key / --label-key"):
        DataSource(DataConfig(path="mem", input_key="question_text"), rows=ROWS)


async def toy_generate(args, sample, sampling_params):
    """A deterministic policy: odd prompts are always answered right, even ones right only by sample 0."""
    question = int(sample.prompt[0]["content"].rsplit("Question: q", 1)[1].split("?")[0])
    right = question % 2 == 1 or sample.index % args.n == 0
    answer = f"a{question}" if right else "wrong"
    sample.tokens = [1, 2]
    sample.append_response_tokens([3, 4], generated=True, log_probs=[-0.1, -0.2], text=f"<answer> {answer} </answer>")
    sample.status = Status.COMPLETED
    return sample


def test_groups_rewards_and_zero_std_filtering_with_oversampling():
    args = search_r1_args(n=4)
    source = DataSource(DataConfig(path="mem"), rows=ROWS)
    config = RolloutConfig(batch_size=3, n_samples_per_prompt=4, filter_zero_std=True)
    groups, metrics = asyncio.run(generate_rollout(args, source, config, toy_generate, reward_func, {}))
    # odd questions: all 4 right (reward 1,1,1,1): no signal, dropped; even: one right of 4: kept.
    # q0, q2 come in the first round (q1 dropped); a second round of 1 prompt (q3) is dropped; q4 fills the batch.
    assert [g[0].metadata["data_source"] for g in groups] == ["nq"] * 3
    assert [g[0].prompt[0]["content"].rsplit("q", 1)[1] for g in groups] == ["0?\n", "2?\n", "4?\n"]
    assert metrics["rollout/groups_dropped_zero_std"] == 2.0
    assert all(len({s.group_index for s in g}) == 1 and len(g) == 4 for g in groups)
    assert metrics["rollout/reward_mean"] == pytest.approx(0.25)


def test_zero_std_filtering_keeps_groups_whose_searches_failed_so_the_health_checks_see_them():
    """During a retriever outage every sample fails alike (reward 0 for all): such groups are not "without signal"
    but broken, and must reach the step's search-failure count instead of being refilled round after round."""
    from slime_search.rollout.sample_metrics import rollout_metrics

    async def failing_generate(args, sample, sampling_params):
        sample.tokens = [1, 2]
        sample.status = Status.FAILED
        sample.metadata["finish_reason"] = "search_error"
        return sample

    args = search_r1_args(n=4)
    source = DataSource(DataConfig(path="mem"), rows=ROWS)
    config = RolloutConfig(batch_size=2, n_samples_per_prompt=4, filter_zero_std=True)
    groups, metrics = asyncio.run(generate_rollout(args, source, config, failing_generate, reward_func, {}))
    assert len(groups) == 2 and metrics["rollout/groups_dropped_zero_std"] == 0.0
    samples = [s for g in groups for s in g]
    assert rollout_metrics(samples)["rollout/search_failures"] == 8.0  # what the guard's pause reads
    assert source.take(1)[0].index == 2  # one round: the outage's groups were not refilled


def test_each_trajectory_gets_a_sampling_seed_of_its_own_from_the_runs_base():
    """The engines see one seed per trajectory, derived from --rollout-seed and the sample's index (unique over the
    run): its draws then do not depend on how requests are batched. Greedy (evaluation) parameters carry none."""
    import argparse

    from slime_search.run.config import sampling_params

    seen: dict[int, dict] = {}

    async def recording_generate(args, sample, params):
        seen[sample.index] = params
        return await toy_generate(args, sample, params)

    args = search_r1_args(n=2)
    source = DataSource(DataConfig(path="mem"), rows=ROWS)
    base = {"temperature": 1.0, "sampling_seed": 42}
    asyncio.run(generate_rollout(args, source, RolloutConfig(batch_size=3, n_samples_per_prompt=2), recording_generate,
                                 reward_func, base, first_group_index=5))  # fmt: skip
    assert sorted(seen) == list(range(10, 16)) and base == {"temperature": 1.0, "sampling_seed": 42}
    seeds = [seen[i]["sampling_seed"] for i in sorted(seen)]
    assert len(set(seeds)) == 6 and all(0 <= seed < 2**31 for seed in seeds)
    assert all(params["temperature"] == 1.0 for params in seen.values())
    flags = argparse.Namespace(rollout_temperature=1.0, rollout_top_p=1.0, rollout_max_response_len=8, rollout_seed=7)
    assert sampling_params(flags)["sampling_seed"] == 7 and "sampling_seed" not in sampling_params(flags, greedy=True)


def test_the_steps_redone_after_a_rollback_draw_seeds_of_their_own_and_a_resume_draws_the_same():
    """After a rollback the same prompts come again from the same weights; with the same seeds the first redone step
    would be the undone one. Each attempt (0, then one more per rollback) moves every trajectory's seed; the same
    attempt, as a resume replays it, gives the same seeds."""
    from slime_search.rollout.rollout import attempt_params, trajectory_params

    base = {"temperature": 1.0, "sampling_seed": 42}
    assert attempt_params(base, 0) == base and base["sampling_seed"] == 42
    seeds = {
        attempt: [trajectory_params(attempt_params(base, attempt), i)["sampling_seed"] for i in range(64)]
        for attempt in range(4)
    }
    assert all(len(set(s)) == 64 and all(0 <= x < 2**31 for x in s) for s in seeds.values())
    for a in range(4):
        for b in range(a + 1, 4):
            assert not set(seeds[a]) & set(seeds[b]), (a, b)  # no trajectory of one attempt repeats another's
    assert seeds[2] == [trajectory_params(attempt_params(base, 2), i)["sampling_seed"] for i in range(64)]
    assert attempt_params({"temperature": 0.0}, 3) == {"temperature": 0.0}  # greedy: nothing to move


def test_advantages_skip_failed_samples_and_split_balances_tokens():
    samples = []
    for group, rewards in enumerate([[1.0, 0.0, 0.0], [1.0, 0.0]]):
        for reward in rewards:
            samples.append(
                Sample(
                    tokens=[0] * (3 + len(samples)),
                    group_index=group,
                    reward={"score": reward},
                    status=Status.COMPLETED,
                )
            )
    samples.append(Sample(tokens=[0] * 50, group_index=1, reward=None, status=Status.FAILED))
    trainable = assign_advantages(samples, "score")
    assert len(trainable) == 5 and "advantage" not in samples[-1].metadata
    # group 1 normalised over its 2 survivors: [1, 0] -> +-0.7071
    assert [round(s.metadata["advantage"], 4) for s in trainable[3:]] == [0.7071, -0.7071]
    shards = split_for_data_parallel(trainable, 2)
    loads = [sum(len(s.tokens) for s in shard) for shard in shards]
    # lengths 3..7, longest first onto the lighter rank: 7 | 6, 5 -> B (11) | 4 -> A (11) | 3 -> A (14)
    assert sorted(loads) == [11, 14] and sum(len(s) for s in shards) == 5
    # fewer samples than ranks: the ranks left over get none (they still join every collective)
    assert [len(shard) for shard in split_for_data_parallel(trainable, 8)] == [1, 1, 1, 1, 1, 0, 0, 0]


def test_row_range_suffix_selects_rows_like_slime(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from slime_search.rollout.data_source import load_rows

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "t.parquet")
    path = tmp_path / "t.parquet"
    assert [r["extra_info"]["index"] for r in load_rows(f"{path}@[2:5]")] == [2, 3, 4]
    assert len(load_rows(f"{path}@[:3]")) == 3 and len(load_rows(f"{path}@[7:]")) == 3
    assert len(load_rows(path)) == 10
    with pytest.raises(FileNotFoundError):
        load_rows(f"{tmp_path / 'missing.parquet'}@[0:3]")


class BadRewards:
    """A reward plugin that returns something other than a number for some samples, or raises."""

    def __init__(self, bad_by_index):
        self.bad_by_index = bad_by_index

    async def __call__(self, args, sample):
        bad = self.bad_by_index.get(sample.index, "ok")
        if isinstance(bad, Exception):
            raise bad
        return {"score": 1.0 if sample.index % 2 else 0.0, "em": 1.0} if bad == "ok" else {"score": bad}


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (float("nan"), "returned nan"),
        (float("inf"), "returned inf"),
        (None, "returned None (NoneType), not a number"),
        ("0.5", "returned '0.5' (str), not a number"),
        (TimeoutError("judge endpoint timed out"), "raised on sample 5: TimeoutError: judge endpoint timed out"),
    ],
)
def test_a_bad_reward_fails_its_sample_and_never_reaches_the_advantages(bad, says):
    args = search_r1_args(n=4)
    source = DataSource(DataConfig(path="mem"), rows=ROWS)
    config = RolloutConfig(batch_size=2, n_samples_per_prompt=4)
    reward = BadRewards({5: bad})
    groups, metrics = asyncio.run(generate_rollout(args, source, config, toy_generate, reward, {}))
    samples = [s for g in groups for s in g]
    [failed] = [s for s in samples if not s.trainable]
    assert failed.index == 5 and failed.status is Status.FAILED and failed.metadata["finish_reason"] == "reward_error"
    assert says in failed.metadata["error"] and "BadRewards" in failed.metadata["error"]
    assert metrics["rollout/reward_errors"] == 1.0 and metrics["rollout/trainable"] == 7.0
    trainable = assign_advantages(samples, "score")
    assert len(trainable) == 7 and all(s.metadata["advantage"] == s.metadata["advantage"] for s in trainable)
    from slime_search.rollout.rollout import first_errors

    # a plugin that timed out failed for a fault that passes (the driver waits it out), the others for good
    passing = isinstance(bad, TimeoutError)
    assert says in first_errors(samples)["reward_error_transient" if passing else "reward_error"]
    assert metrics["rollout/reward_errors_transient"] == float(passing)


def test_non_finite_engine_log_probs_fail_the_sample_before_the_reward():
    async def nan_generate(args, sample, params):
        sample = await toy_generate(args, sample, params)
        if sample.index == 0:
            sample.rollout_log_probs[1] = float("nan")
        return sample

    source = DataSource(DataConfig(path="mem"), rows=ROWS)
    config = RolloutConfig(batch_size=1, n_samples_per_prompt=2)
    groups, metrics = asyncio.run(generate_rollout(search_r1_args(n=2), source, config, nan_generate, reward_func, {}))
    assert groups[0][0].metadata["finish_reason"] == "nonfinite_logprob" and groups[0][0].reward is None
    assert metrics["rollout/nonfinite_log_probs"] == 1.0


def test_batch_metrics_describe_the_reward_spread_lengths_and_groups_without_signal():
    args = search_r1_args(n=4)
    source = DataSource(DataConfig(path="mem"), rows=ROWS)
    config = RolloutConfig(batch_size=2, n_samples_per_prompt=4)
    groups, metrics = asyncio.run(generate_rollout(args, source, config, toy_generate, reward_func, {}))
    # q0: one right of 4 (signal); q1: all right (no signal)
    assert metrics["rollout/zero_std_group_share"] == 0.5
    assert metrics["rollout/reward_mean"] == pytest.approx(5 / 8)
    assert metrics["rollout/reward_std"] == pytest.approx((5 / 8 * 3 / 8) ** 0.5)
    assert metrics["rollout/response_length_p90"] == 2.0 and metrics["rollout/response_length_max"] == 2.0
    assert metrics["rollout/reward_em"] == pytest.approx(5 / 8)  # the reward's other keys, averaged


def first_request_before_last_preparation(start) -> bool:
    """Runs `start(generate)` with a generate that notes when it prepares a request and when the request leaves (one
    turn of the event loop later, as a pooled connection's write does); whether the first request left before the
    last trajectory was prepared."""
    events: list[tuple[str, int]] = []

    async def generate(args, sample, params):
        events.append(("prepared", sample.index))
        await asyncio.sleep(0)
        events.append(("sent", sample.index))
        await asyncio.sleep(0.001)
        return await toy_generate(args, sample, params)

    start(generate)
    prepared = [i for i, (what, _) in enumerate(events) if what == "prepared"]
    assert len(prepared) == 10 * 4
    return events.index(("sent", 0)) < prepared[-1]


def test_the_first_requests_leave_before_the_whole_batch_is_prepared():
    """The engines get work as soon as the first group is ready, not after every sample of the batch was tokenised
    and its connection opened (seconds of an idle engine at thousands of samples)."""
    source = DataSource(DataConfig(path="mem"), rows=ROWS)
    config = RolloutConfig(batch_size=10, n_samples_per_prompt=4)

    def run(generate):
        asyncio.run(generate_rollout(search_r1_args(n=4), source, config, generate, reward_func, {}))

    assert first_request_before_last_preparation(run)
