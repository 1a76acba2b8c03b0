"""Megatron ranks as Ray actors on CPU bundles: TP=2 and DP=2 take the same steps on the same global batch, and report
the same metrics for it."""

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
    from slime_search.ray.train_group import ModelSource, RayTrainGroup, TrainGroupConfig, split_for_data_parallel

    group = RayTrainGroup(TrainGroupConfig(num_ranks=tp * dp, tp_size=tp))
    try:
        loss = LossConfig(vocab_size=151936, use_tis=True, eps_clip_c=3.0)
        config = ActorConfig(loss=loss, optim=OptimConfig(lr=1e-3), max_tokens_per_micro_batch=24)
        group.load_models(ModelSource(str(checkpoint)), config)
        layout = group.checkpoint_layout()
        samples = fixed_batch()
        shards = [samples[d::dp] for d in range(dp)]
        for shard, log_probs in zip(shards, group.compute_log_probs(shards), strict=True):
            for sample, lp in zip(shard, log_probs, strict=True):
                sample.old_log_probs = sample.rollout_log_probs = lp
        history = [group.train_step(shards) for _ in range(steps)]
        # a whole rollout whose engine log-probs agree with the trainer's: the DP split train() makes, so the old
        # log-probs it computes are these very numbers
        rollout = fixed_batch()
        split = split_for_data_parallel(rollout, dp)
        for shard, log_probs in zip(split, group.compute_log_probs(split), strict=True):
            for sample, lp in zip(shard, log_probs, strict=True):
                sample.rollout_log_probs = lp
        # two optimizer steps on its halves
        metrics = group.train(rollout, steps=2)
        # a rollout left with one trainable sample still trains at DP 2 (one rank has nothing: a zero share)
        [sample] = fixed_batch()[:1]
        sample.rollout_log_probs = [-5.0] * sample.response_length
        lone = group.train([sample], steps=1)
        assert lone["train/steps_applied"] == 1 and lone["train/loss"] == lone["train/loss"]
        return history, metrics, layout
    finally:
        group.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tensor_and_data_parallel_groups_agree(ray_session, tiny_checkpoint):
    tp2, tp2_rollout, tp2_layout = run_group(ray_session, tiny_checkpoint, tp=2, dp=1)
    dp2, dp2_rollout, dp2_layout = run_group(ray_session, tiny_checkpoint, tp=1, dp=2)
    # the loss is normalised by global counts, so DP=2 (half the batch each, DDP-averaged gradients) takes the
    # same steps as one rank (here two TP ranks) holding the whole batch
    assert [h["loss"] for h in dp2] == pytest.approx([h["loss"] for h in tp2], abs=1e-5)
    assert [h["grad_norm"] for h in dp2] == pytest.approx([h["grad_norm"] for h in tp2], rel=1e-4)
    assert tp2[-1]["loss"] < tp2[0]["loss"]
    # every metric describes the whole batch at any data-parallel size: each rank's share is summed (rank 0's alone
    # read tis_weight_mean 0.5 at DP 2), the gradient norm and what the ranks all-reduced taken once
    assert set(dp2_rollout) == set(tp2_rollout) and {"train/tis_weight_mean", "train/entropy"} <= set(dp2_rollout)
    for name, value in tp2_rollout.items():
        assert dp2_rollout[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    # engine and trainer log-probs agree bit for bit: every weight is 1, and so is their mean, at DP 1 and DP 2
    assert [step["tis_weight_mean"] for step in (*tp2, *dp2)] == [1.0] * 6
    assert dp2_rollout["train/tis_weight_mean"] == tp2_rollout["train/tis_weight_mean"] == 1.0
    assert dp2_rollout["train/steps_applied"] == tp2_rollout["train/steps_applied"] == 2
    # what one checkpoint holds, from the ranks as built: the model once (TP 2 pads the vocabulary to 152,064 rows of
    # 64), the optimizer state per tensor-parallel slice (DP 2: one slice, the whole model; TP 2: two halves plus the
    # 5 RMSNorm weights of 64 each slice holds whole)
    assert tp2_layout.model_parameters == dp2_layout.model_parameters + (152_064 - 151_936) * 64
    assert dp2_layout.slice_parameters == (dp2_layout.model_parameters,)
    replicated = 5 * 64
    assert tp2_layout.slice_parameters == ((tp2_layout.model_parameters - replicated) // 2 + replicated,) * 2


def test_ranks_use_the_nccl_memory_mode_of_sglangs_engines():
    """SGLang's engines run with NCCL_CUMEM_ENABLE=0; a trainer rank in the same NCCL group must too."""
    from slime_search.ray.train_group import TrainGroupConfig, rank_options

    on_gpu = rank_options(TrainGroupConfig(num_ranks=2, use_gpu=True))
    assert on_gpu["runtime_env"]["env_vars"]["NCCL_CUMEM_ENABLE"] == "0" and on_gpu["num_gpus"] == 1
    # Megatron's sequence-parallel communication overlap needs kernels in launch order: one connection per device
    assert on_gpu["runtime_env"]["env_vars"]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert rank_options(TrainGroupConfig(num_ranks=2))["num_gpus"] == 0


def test_every_sample_is_trained_when_the_rollout_does_not_divide_into_steps():
    from slime_search.ray.train_group import split_into_steps

    parts = split_into_steps(list(range(255)), 2)
    assert [len(p) for p in parts] == [128, 127] and sum(parts, []) == list(range(255))
    assert [len(p) for p in split_into_steps(list(range(62)), 4)] == [16, 16, 15, 15]
    with pytest.raises(ValueError, match="> 0"):
        split_into_steps([1], 0)


def test_rank_metrics_are_summed_except_those_every_rank_holds_whole():
    from slime_search.ray.train_group import mean_step_metrics, reduce_over_data_parallel

    ranks = [
        {"loss": 0.25, "tis_weight_mean": 0.5, "grad_norm": 3.0, "step_applied": 1.0, "kl_old_new": 0.01},
        {"loss": 0.5, "tis_weight_mean": 0.5, "grad_norm": 3.0, "step_applied": 1.0, "kl_old_new": 0.01},
    ]
    assert reduce_over_data_parallel(ranks) == {
        "loss": 0.75,
        "tis_weight_mean": 1.0,
        "grad_norm": 3.0,
        "step_applied": 1.0,
        "kl_old_new": 0.01,
    }
    steps = [
        {"loss": 1.0, "grad_norm": 2.0, "step_applied": 1.0},
        {"loss": 3.0, "grad_norm": float("nan"), "step_applied": 0.0},
    ]
    record = mean_step_metrics(steps)
    assert record["train/loss"] == 2.0 and record["train/steps_applied"] == 1.0 and record["train/steps"] == 2.0
    assert record["train/grad_norm_max"] != record["train/grad_norm_max"]  # a NaN norm is the maximum: it is reported
