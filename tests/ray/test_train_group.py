"""Megatron ranks as Ray actors on CPU bundles: TP=2 and DP=2 take the same steps on the same global batch."""

import pytest

from tests.backends.test_megatron_train import fixed_batch


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def run_group(ray_session, checkpoint, tp, dp, steps=3):
    from slime_search.backends.megatron.actor import ActorConfig
    from slime_search.backends.megatron.loss import LossConfig
    from slime_search.backends.megatron.optimizer import OptimConfig
    from slime_search.ray.train_group import ModelSource, RayTrainGroup, TrainGroupConfig

    group = RayTrainGroup(TrainGroupConfig(num_ranks=tp * dp, tp_size=tp))
    try:
        config = ActorConfig(loss=LossConfig(vocab_size=151936), optim=OptimConfig(lr=1e-3))
        group.load_models(ModelSource(str(checkpoint)), config)
        samples = fixed_batch()
        shards = [samples[d::dp] for d in range(dp)]
        for shard, log_probs in zip(shards, group.compute_log_probs(shards), strict=True):
            for sample, lp in zip(shard, log_probs, strict=True):
                sample.old_log_probs = lp
        history = [group.train_step(shards) for _ in range(steps)]
        # a whole rollout: old log-probs, the DP split by tokens, two optimizer steps on its halves
        return history, group.train(fixed_batch(), steps=2)
    finally:
        group.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tensor_and_data_parallel_groups_agree(ray_session, tiny_checkpoint):
    tp2, tp2_rollout = run_group(ray_session, tiny_checkpoint, tp=2, dp=1)
    dp2, dp2_rollout = run_group(ray_session, tiny_checkpoint, tp=1, dp=2)
    # the loss is normalised by global counts, so DP=2 (half the batch each, DDP-averaged gradients) takes the
    # same steps as one rank (here two TP ranks) holding the whole batch
    assert [h["loss"] for h in dp2] == pytest.approx([h["loss"] for h in tp2], abs=1e-5)
    assert [h["grad_norm"] for h in dp2] == pytest.approx([h["grad_norm"] for h in tp2], rel=1e-4)
    assert tp2[-1]["loss"] < tp2[0]["loss"]
    assert dp2_rollout["train/grad_norm"] == pytest.approx(tp2_rollout["train/grad_norm"], rel=1e-4)
    assert dp2_rollout["train/loss"] == pytest.approx(tp2_rollout["train/loss"], abs=1e-5)


def test_ranks_use_the_nccl_memory_mode_of_sglangs_engines():
    """SGLang's engines run with NCCL_CUMEM_ENABLE=0; a trainer rank in the same NCCL group must too."""
    from slime_search.ray.train_group import TrainGroupConfig, rank_options

    on_gpu = rank_options(TrainGroupConfig(num_ranks=2, use_gpu=True))
    assert on_gpu["runtime_env"]["env_vars"]["NCCL_CUMEM_ENABLE"] == "0" and on_gpu["num_gpus"] == 1
    assert rank_options(TrainGroupConfig(num_ranks=2))["num_gpus"] == 0
