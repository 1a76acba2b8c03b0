"""The rollout stream of asynchronous training: admission bounded by the policy version, batches of complete groups in
the order they finish, draining, the prompts a checkpoint gives back, dropped groups freeing their place, and the
staleness each batch carries, token by token."""

import threading
import time

import pytest

from slime_search.plugins import Plugins
from slime_search.rollout.data_source import DataConfig, DataSource
from slime_search.rollout.rollout import RolloutConfig
from slime_search.rollout.sample_metrics import staleness_metrics
from slime_search.rollout.stream import ActivityClock, RolloutStream, StreamConfig
from slime_search.search_r1.config import search_r1_args
from slime_search.search_r1.prompt import make_row
from slime_search.search_r1.reward import reward_func
from slime_search.types import Sample, Status

pytestmark = pytest.mark.timeout(60)

ROWS = [make_row({"question": f"q{i}", "golden_answers": [f"a{i}"]}, "nq", "train", i) for i in range(40)]


class ToyEngine:
    """What the toy policy sees of an engine: the weight version it serves (a test changes it while trajectories
    run), and a gate per question that holds that question's trajectories until the test opens it."""

    def __init__(self):
        self.version = 0
        self.gates: dict[int, threading.Event] = {}
        self.all_right = False  # every sample answers right: groups without reward signal
        self.at_gates: list[int] = []  # one entry per trajectory that generated its first tokens and waits

    def gate(self, question: int) -> threading.Event:
        return self.gates.setdefault(question, threading.Event())


def question_of(sample: Sample) -> int:
    return int(sample.prompt[0]["content"].rsplit("Question: q", 1)[1].split("?")[0])


async def toy_generate(args, sample, params):
    """Two tokens, then the question's gate, then two more tokens and the answer; every token stamped with the
    version the engine serves when it is generated. Sample 0 of a group answers right, the others wrong."""
    import asyncio

    engine, question = args.engine, question_of(sample)
    sample.tokens = [1, 2]
    sample.append_response_tokens([3, 4], generated=True, log_probs=[-0.1, -0.2], versions=[engine.version] * 2)
    engine.at_gates.append(question)
    while not engine.gate(question).is_set():
        await asyncio.sleep(0.002)
    right = engine.all_right or sample.index % args.n == 0
    answer = f"<answer> {f'a{question}' if right else 'wrong'} </answer>"
    sample.append_response_tokens(
        [5, 6], generated=True, log_probs=[-0.3, -0.4], text=answer, versions=[engine.version] * 2
    )
    sample.status = Status.COMPLETED
    return sample


def make_stream(
    engine, batch_size=2, n=2, staleness=1, filter_zero_std=False, rows=ROWS, generate=toy_generate, order="completion"
):
    source = DataSource(DataConfig(path="mem"), rows=rows)
    config = StreamConfig(RolloutConfig(batch_size, n, filter_zero_std=filter_zero_std), staleness, order)
    args = search_r1_args(engine=engine, n=n)  # the reward plugin reads the task's flags
    return RolloutStream(Plugins(generate, reward_func), args, source, config, {}, policy_version=0), source


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def questions(groups: list[list[Sample]]) -> list[int]:
    return [question_of(group[0]) for group in groups]


def test_admission_stops_max_staleness_batches_ahead_and_each_version_lets_one_more_batch_in():
    engine = ToyEngine()
    stream, _ = make_stream(engine, batch_size=2, staleness=2)
    stream.start()
    try:
        wait_until(lambda: stream.counts()["async/groups_admitted"] == 6)  # (0 + 2 + 1) batches of 2 groups
        time.sleep(0.2)
        assert stream.counts()["async/groups_admitted"] == 6 and stream.counts()["async/groups_in_flight"] == 6
        stream.set_policy_version(1)
        wait_until(lambda: stream.counts()["async/groups_admitted"] == 8)
        time.sleep(0.2)
        assert stream.counts()["async/groups_admitted"] == 8
    finally:
        stream.stop()


def test_a_batch_is_complete_groups_in_the_order_they_finish_and_a_slow_group_lands_later():
    engine = ToyEngine()
    stream, _ = make_stream(engine, batch_size=2, n=3, staleness=1)
    stream.start()
    try:
        engine.gate(2).set()  # q0, admitted first, is slow: its gate stays shut
        wait_until(lambda: stream.counts()["async/groups_ready"] == 1)
        engine.gate(1).set()
        first = stream.take_batch(timeout_s=10)
        assert questions(first) == [2, 1]  # the order they finished in
        assert all(len(group) == 3 and len({s.group_index for s in group}) == 1 for group in first)
        assert all(s.reward is not None for group in first for s in group)
        stream.set_policy_version(1)
        engine.gate(0).set()
        wait_until(lambda: stream.counts()["async/groups_ready"] == 1)
        engine.gate(4).set()  # admitted once version 1 opened a batch of room
        second = stream.take_batch(timeout_s=10)
        assert questions(second) == [0, 4]
    finally:
        stream.stop()


def test_in_admission_order_a_batch_waits_for_the_first_admitted_groups():
    """Completion order favours what finishes fast (short trajectories); admission order takes the groups in the order
    they were admitted, however long they run."""
    engine = ToyEngine()
    stream, _ = make_stream(engine, batch_size=2, n=2, staleness=1, order="admission")
    stream.start()
    try:
        engine.gate(2).set()
        engine.gate(3).set()  # q2 and q3 finish first; q0 and q1, admitted first, are slow
        wait_until(lambda: stream.counts()["async/groups_ready"] == 2)
        with pytest.raises(TimeoutError):
            stream.take_batch(timeout_s=0.2)
        engine.gate(1).set()
        engine.gate(0).set()
        assert questions(stream.take_batch(timeout_s=10)) == [0, 1]
        assert questions(stream.take_batch(timeout_s=10)) == [2, 3]
    finally:
        stream.stop()


def test_tokens_older_than_the_bound_leave_the_loss_and_stay_in_the_context():
    from slime_search.rollout.sample_metrics import mask_stale_tokens
    from slime_search.types import TrainSample

    # trainer at version 6; tokens of versions 2, 3, 4 (generated), an observation (-1), 5 and 6
    sample = TrainSample([1, 2, 3, 4, 5, 6, 7, 8], 6, [1, 1, 1, 0, 1, 1], token_versions=[2, 3, 4, -1, 5, 6])
    assert mask_stale_tokens([sample], trainer_version=6, max_lag=2) == 2  # lags 4 and 3
    assert sample.loss_mask == [0, 0, 1, 0, 1, 1] and sample.tokens == [1, 2, 3, 4, 5, 6, 7, 8]
    assert mask_stale_tokens([sample], trainer_version=6, max_lag=2) == 0


def test_drain_waits_for_the_groups_in_flight():
    engine = ToyEngine()
    stream, _ = make_stream(engine, batch_size=1, staleness=1)
    stream.start()
    try:
        wait_until(lambda: stream.counts()["async/groups_in_flight"] == 2)
        with pytest.raises(TimeoutError):
            stream.drain(timeout_s=0.2)
        engine.gate(0).set()
        engine.gate(1).set()
        stream.drain(timeout_s=10)
        assert stream.counts()["async/groups_in_flight"] == 0 and stream.counts()["async/groups_ready"] == 2
    finally:
        stream.stop()


def test_a_checkpoint_gives_back_every_prompt_admitted_and_not_taken_in_admission_order():
    engine = ToyEngine()
    stream, _ = make_stream(engine, batch_size=2, staleness=1)
    stream.start()
    try:
        for question in (0, 2, 3):
            engine.gate(question).set()
        taken = questions(stream.take_batch(timeout_s=10))  # two of q0, q2, q3 (q1 is held)
        stream.set_policy_version(1)
        wait_until(lambda: stream.counts()["async/groups_admitted"] == 6)
        state = stream.data_state()
    finally:
        stream.stop()
    admitted = list(range(6))
    assert state["given_back"] == [q for q in admitted if q not in taken]
    resumed = DataSource(DataConfig(path="mem"), rows=ROWS)
    resumed.load_state_dict(state)
    again = [item.index for item in resumed.take(6)]
    assert again == state["given_back"] + [6, 7] and not set(again) & set(taken)


def test_groups_without_signal_are_dropped_and_free_their_place():
    engine = ToyEngine()
    engine.all_right = True
    stream, _ = make_stream(engine, batch_size=2, staleness=1, filter_zero_std=True)
    stream.start()
    try:
        for question in range(4):
            engine.gate(question).set()
        wait_until(lambda: stream.counts()["async/groups_dropped_zero_std"] >= 4)
        assert stream.counts()["async/groups_admitted"] >= 8  # every dropped group was replaced
        engine.all_right = False
        for question in range(4, 40):
            engine.gate(question).set()
        batch = stream.take_batch(timeout_s=10)
        assert len(batch) == 2 and all(len({s.reward["score"] for s in g}) > 1 for g in batch)
    finally:
        stream.stop()


def test_a_version_change_mid_trajectory_shows_in_its_tokens_and_in_the_batch_staleness():
    engine = ToyEngine()
    stream, _ = make_stream(engine, batch_size=2, n=2, staleness=1)
    stream.start()
    try:
        # Admitted is not yet generating: the push waits until all 8 trajectories hold their version-0 tokens.
        wait_until(lambda: len(engine.at_gates) == 8)
        engine.version = 1  # a push while every trajectory waits at its gate
        for question in range(8):
            engine.gate(question).set()
        batch = stream.take_batch(timeout_s=10)
    finally:
        stream.stop()
    samples = [s for group in batch for s in group]
    assert all(s.generated_versions() == [0, 0, 1, 1] for s in samples)
    assert all(len(s.token_versions) == s.response_length == len(s.rollout_log_probs) for s in samples)
    metrics = staleness_metrics(samples, trainer_version=1)
    assert metrics["async/interrupted_trajectories"] == 4
    assert metrics["async/staleness_tokens_lag_0"] == 0.5 and metrics["async/staleness_tokens_lag_1"] == 0.5
    assert metrics["async/staleness_trajectories_lag_1"] == 1.0 and metrics["async/staleness_max"] == 1


def test_a_plugin_fault_reaches_the_trainer():
    async def broken(args, sample, params):
        raise ValueError("the plugin broke")

    stream, _ = make_stream(ToyEngine(), generate=broken)
    stream.start()
    try:
        with pytest.raises(RuntimeError, match="rollout stream failed") as failed:
            stream.take_batch(timeout_s=10)
        assert isinstance(failed.value.__cause__, ValueError)
    finally:
        stream.stop()


def test_staleness_by_token_and_trajectory_by_hand():
    """Trainer at version 5. Sample a: tokens of versions 3, 3, 4 (interrupted; oldest 3 -> lag 2). Sample b: 5, 5
    (lag 0). An observation token (-1) counts for nothing. Tokens: lag 2: 2, lag 1: 1, lag 0: 2 of 5."""
    a, b = Sample(tokens=[9]), Sample(tokens=[9])
    a.append_response_tokens([1, 2], generated=True, log_probs=[0.0, 0.0], versions=[3, 3])
    a.append_response_tokens([7], generated=False)
    a.append_response_tokens([3], generated=True, log_probs=[0.0], versions=[4])
    b.append_response_tokens([1, 2], generated=True, log_probs=[0.0, 0.0], versions=[5, 5])
    metrics = staleness_metrics([a, b], trainer_version=5)
    assert metrics == {
        "async/interrupted_trajectories": 1.0,
        "async/staleness_tokens_lag_0": 2 / 5,
        "async/staleness_tokens_lag_1": 1 / 5,
        "async/staleness_tokens_lag_2": 2 / 5,
        "async/staleness_trajectories_lag_0": 0.5,
        "async/staleness_trajectories_lag_2": 0.5,
        "async/staleness_tokens_mean": (0 * 2 + 1 * 1 + 2 * 2) / 5,
        "async/staleness_max": 2.0,
    }


def test_the_activity_clock_counts_time_with_nothing_in_flight():
    """On a clock the test moves by hand: idle 2 s, two trajectories overlapping for 3 s, idle 1 s (read); busy 4 s
    (read); idle 0.25 s (read)."""
    now = [100.0]
    clock = ActivityClock(now=lambda: now[0])
    now[0] += 2.0
    clock.started()
    now[0] += 1.0
    clock.started()
    now[0] += 1.5
    clock.finished()  # one still in flight: not idle yet
    now[0] += 0.5
    clock.finished()
    now[0] += 1.0
    assert clock.read() == (3.0, 6.0)
    clock.started()
    now[0] += 4.0
    assert clock.read() == (0.0, 4.0)  # busy through the whole interval
    clock.finished()
    now[0] += 0.25
    assert clock.read() == (0.25, 0.25)


def test_admitted_groups_send_their_first_requests_before_the_last_group_is_prepared():
    """As in a synchronous rollout (tests/rollout/test_rollout.py): after a push, the engines get the first admitted
    group's requests at once, not after every admitted group has prepared its own."""
    from tests.rollout.test_rollout import first_request_before_last_preparation

    def run(generate):
        stream, _ = make_stream(ToyEngine(), batch_size=5, n=4, staleness=1, generate=generate)
        stream.start()  # admits (0 + 1 + 1) batches of 5 groups of 4: the 40 samples the helper expects
        try:
            stream.take_batch(timeout_s=10)
            stream.take_batch(timeout_s=10)
        finally:
            stream.stop()

    assert first_request_before_last_preparation(run)


def test_a_version_set_while_groups_are_being_admitted_still_admits_its_batch():
    """Admission gives the event loop a turn after each group, so a new version can arrive in the middle of it; its
    wake-up must not be lost (no group finishes here to wake the stream again)."""
    engine = ToyEngine()  # every gate stays shut: nothing finishes
    holder = {}

    async def sets_the_version_on_its_first_call(args, sample, params):
        if not holder.get("set"):
            holder["set"] = True
            holder["stream"].set_policy_version(1)  # during the admission of the first 4 groups
        return await toy_generate(args, sample, params)

    stream, _ = make_stream(engine, batch_size=2, n=1, staleness=1, generate=sets_the_version_on_its_first_call)
    holder["stream"] = stream
    stream.start()
    try:
        wait_until(lambda: stream.counts()["async/groups_admitted"] == 6, timeout_s=5)  # (1 + 1 + 1) batches of 2
    finally:
        for question in range(40):
            engine.gate(question).set()
        stream.stop()
