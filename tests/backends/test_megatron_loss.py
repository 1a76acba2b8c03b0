"""The micro-batch loss on leaf logits (no model): masking, references, and log-probs at a temperature."""

import pytest
import torch

from slime_search.backends.megatron.loss import LossConfig, micro_batch_loss, response_logits_and_targets
from slime_search.backends.megatron.packing import pack, split_by_token_budget
from slime_search.types import TrainSample


def test_pack_positions_boundaries_and_mask():
    packed = pack([[1, 2, 3], [4, 5]], [2, 1])
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert packed.cu_seqlens.tolist() == [0, 3, 5]
    assert packed.response_slices() == [slice(1, 3), slice(4, 5)]
    allowed = ~packed.attention_mask()[0, 0]
    # causal inside each sample, nothing across: token 3 (sample 2's first) sees only itself
    assert allowed[3].tolist() == [False, False, False, True, False]
    assert allowed[2].tolist() == [True, True, True, False, False]
    with pytest.raises(ValueError, match="needs a prompt token"):
        pack([[1, 2]], [2])


def test_split_by_token_budget_first_fit_decreasing():
    # lengths 5,4,3,3,1 with budget 8: 5+3, 4+3+1
    assert split_by_token_budget([5, 4, 3, 3, 1], 8) == [[0, 2], [1, 3, 4]]
    assert split_by_token_budget([10, 2], 8) == [[0], [1]]  # an over-long sample goes alone
    with pytest.raises(ValueError, match="max_tokens"):
        split_by_token_budget([1], 0)


def make_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    samples = [
        TrainSample(tokens=[1, 2, 3, 4, 5, 6], response_length=4, loss_mask=[1, 0, 0, 1], advantage=1.0),
        TrainSample(tokens=[7, 8, 9], response_length=2, loss_mask=[1, 1], advantage=-0.5),
    ]
    packed = pack([s.tokens for s in samples], [s.response_length for s in samples])
    logits = torch.randn(1, packed.num_tokens, 12, generator=gen, requires_grad=True)
    return samples, packed, logits


def test_response_rows_are_shifted_by_one():
    samples, packed, logits = make_batch()
    rows, targets = response_logits_and_targets(logits, packed)
    assert targets.tolist() == [3, 4, 5, 6, 8, 9]
    assert torch.equal(rows[0], logits[0, 1]) and torch.equal(rows[4], logits[0, 6])


@pytest.mark.parametrize("loss_type", ["policy_loss", "sft"])
def test_masked_tokens_and_prompts_get_no_gradient(loss_type):
    samples, packed, logits = make_batch()
    config = LossConfig(loss_type=loss_type, kl_coef=0.0)
    loss, _ = micro_batch_loss(logits, packed, samples, config, num_tokens=4, num_sequences=2)
    loss.backward()
    grad_rows = logits.grad[0].abs().sum(-1)
    # rows predicting: sample 1 tokens at 2,3,4,5 (logit rows 1,2,3,4; mask 1,0,0,1); sample 2 tokens 7,8 (rows 6,7)
    trained_rows = {1, 4, 6, 7}
    for row in range(packed.num_tokens):
        assert bool(grad_rows[row] > 0) is (row in trained_rows), row


def test_sft_loss_is_the_masked_negative_log_likelihood_at_temperature():
    samples, packed, logits = make_batch()
    config = LossConfig(loss_type="sft", reduction="token_mean", temperature=0.5)
    loss, _ = micro_batch_loss(logits, packed, samples, config, num_tokens=4, num_sequences=2)
    log_probs = torch.log_softmax(logits[0].detach() / 0.5, -1)
    # trained (row, target) pairs: (1,3), (4,6), (6,8), (7,9)
    expected = -(log_probs[1, 3] + log_probs[4, 6] + log_probs[6, 8] + log_probs[7, 9]) / 4
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_only_sft_goes_without_the_old_log_probs():
    """The driver computes the old policy's log-probs only for a loss that reads them: SFT's is computed from the
    current logits alone (its samples here have none), the policy loss's is not."""
    samples, packed, logits = make_batch()
    assert all(s.old_log_probs is None for s in samples)
    assert not LossConfig(loss_type="sft").uses_old_log_probs
    loss, _ = micro_batch_loss(logits, packed, samples, LossConfig(loss_type="sft"), num_tokens=4, num_sequences=2)
    assert torch.isfinite(loss)
    assert LossConfig(loss_type="policy_loss").uses_old_log_probs


def test_kl_and_tis_need_their_inputs():
    samples, packed, logits = make_batch()
    with pytest.raises(ValueError, match="TIS/MIS need the engine's log-probs"):
        micro_batch_loss(logits, packed, samples, LossConfig(use_tis=True), num_tokens=4, num_sequences=2)
    with pytest.raises(ValueError, match="ref_log_probs missing"):
        micro_batch_loss(logits, packed, samples, LossConfig(kl_coef=0.1), num_tokens=4, num_sequences=2)
    for s in samples:
        s.rollout_log_probs = [-1.0] * s.response_length
        s.ref_log_probs = [-1.0] * (s.response_length - 1)
    with pytest.raises(ValueError, match="ref_log_probs has 3 entries for a response of 4"):
        micro_batch_loss(logits, packed, samples, LossConfig(kl_coef=0.1, use_tis=True), num_tokens=4, num_sequences=2)
    with pytest.raises(ValueError, match="valid: policy_loss, sft"):
        LossConfig(loss_type="dpo")


def test_padded_vocabulary_columns_are_excluded():
    from slime_search.backends.megatron.logprobs import entropy, token_log_probs

    gen = torch.Generator().manual_seed(3)
    real = torch.randn(5, 10, generator=gen)
    padded = torch.cat([real, torch.zeros(5, 6)], dim=-1)  # Megatron's padding rows give logit 0
    targets = torch.tensor([0, 3, 9, 2, 5])
    expected = torch.log_softmax(real, -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(token_log_probs(padded, targets, vocab_size=10), expected)
    assert not torch.allclose(token_log_probs(padded, targets), expected)  # what leaving them in does
    p = torch.softmax(real, -1)
    torch.testing.assert_close(entropy(padded, vocab_size=10), -(p * p.log()).sum(-1))


def test_mis_weights_and_mask_enter_the_policy_loss():
    from slime_search.algo import ISConfig

    samples, packed, logits = make_batch()
    rows, targets = response_logits_and_targets(logits.detach(), packed)
    on_policy = torch.log_softmax(rows, -1).gather(-1, targets[:, None]).squeeze(-1).tolist()
    samples[0].old_log_probs, samples[1].old_log_probs = on_policy[:4], on_policy[4:]
    for s in samples:
        s.rollout_log_probs = list(s.old_log_probs)
    # old == rollout: every weight is 1 and nothing is masked, so MIS leaves the loss as it is
    base, _ = micro_batch_loss(logits, packed, samples, LossConfig(), num_tokens=4, num_sequences=2)
    same, _ = micro_batch_loss(
        logits, packed, samples, LossConfig(mis=ISConfig(mode="mask")), num_tokens=4, num_sequences=2
    )
    assert same.item() == pytest.approx(base.item())
    # a rollout log-prob 3 nats below the trainer's (ratio e^3 > 2) takes that token out of the loss:
    # sample 2 then averages over its second token only
    samples[1].rollout_log_probs = [on_policy[4] - 3.0, on_policy[5]]
    masked, _ = micro_batch_loss(
        logits, packed, samples, LossConfig(mis=ISConfig(mode="mask")), num_tokens=4, num_sequences=2
    )
    # per-token surrogate at ratio 1 is -A: sample 1 -> -1, sample 2 -> +0.5 either way; the mean is unchanged,
    # but the masked token now gets no gradient
    masked.backward()
    assert logits.grad[0, 6].abs().sum() == 0 and logits.grad[0, 7].abs().sum() > 0
    with pytest.raises(ValueError, match="not both"):
        LossConfig(use_tis=True, mis=ISConfig())


ADDITIVE_CONFIGS = {
    "tis, kl, entropy, llds": LossConfig(use_tis=True, kl_coef=0.1, entropy_coef=0.01, llds_coef=0.1),
    "token mean": LossConfig(use_tis=True, reduction="token_mean", eps_clip_c=3.0),
    "mis, batch-normalised mask": None,  # built in the test: it needs the batch's normaliser
    "sft": LossConfig(loss_type="sft"),
}


@pytest.mark.parametrize("name", list(ADDITIVE_CONFIGS))
def test_every_metric_of_the_loss_adds_up_over_micro_batches_to_the_whole_batchs(name):
    """The actor sums each metric over a step's micro-batches and the data-parallel ranks: each must be the micro-batch's
    share of a whole-batch quantity. A mean of the micro-batch alone (the MIS statistics once were) reads the number
    of micro-batches times too high."""
    from slime_search.algo import ISConfig
    from slime_search.backends.megatron.loss import local_mis_stats

    samples = complete_batch() + [
        TrainSample(
            [3, 1, 4, 1, 5, 9],
            4,
            [1, 1, 0, 1],
            1.5,
            [-0.3, -2.5, 0.0, -1.0],
            [-2.0, -2.4, 0.0, -0.1],
            [-0.4, -2.0, 0.0, -1.0],
        )
    ]
    config = ADDITIVE_CONFIGS[name]
    normalizer = None
    if config is None:
        mis = ISConfig(mode="mask", upper=2.0, batch_normalize=True)
        config, normalizer = LossConfig(mis=mis), local_mis_stats(samples, mis, torch.device("cpu")).float()
    gen = torch.Generator().manual_seed(0)
    sample_logits = [torch.randn(1, len(s.tokens), 16, generator=gen) for s in samples]
    num_tokens, num_sequences = float(sum(sum(s.loss_mask) for s in samples)), len(samples)

    def metrics_of(groups: list[list[int]]) -> dict[str, float]:
        totals: dict[str, float] = {}
        for group in groups:
            batch = [samples[i] for i in group]
            packed = pack([s.tokens for s in batch], [s.response_length for s in batch])
            logits = torch.cat([sample_logits[i] for i in group], dim=1)
            _, metrics = micro_batch_loss(logits, packed, batch, config, num_tokens, num_sequences, normalizer)
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + float(value)
        return totals

    whole, split = metrics_of([[0, 1, 2]]), metrics_of([[0], [1, 2]])
    assert set(split) == set(whole) and whole
    for key, value in whole.items():
        assert split[key] == pytest.approx(value, abs=1e-6), key


def complete_batch():
    """Samples with every per-token list the loss can read: old, rollout and reference log-probs."""
    return [
        TrainSample([1, 2, 3, 4, 5], 3, [1, 1, 0], 0.5, [-1.0, -2.0, 0.0], [-1.1, -2.1, 0.0], [-1.0, -2.2, 0.0]),
        TrainSample([6, 7, 8, 9], 2, [1, 1], -0.5, [-1.0, -0.5], [-1.0, -0.6], [-1.2, -0.5]),
    ]


@pytest.mark.parametrize("reduction", ["sequence_mean", "token_mean"])
def test_every_tensor_the_loss_builds_follows_the_logits_device(reduction):
    """The batch arrives on the CPU, the logits live on the model's device. PyTorch's meta device refuses to mix with
    CPU tensors as CUDA does, so a mask, target or log-prob left on the CPU fails here as it would on a GPU."""
    from slime_search.backends.megatron.logprobs import entropy, token_log_probs

    samples = complete_batch()
    packed = pack([s.tokens for s in samples], [s.response_length for s in samples])
    logits = torch.empty(1, packed.num_tokens, 16, device="meta", requires_grad=True)
    config = LossConfig(kl_coef=0.1, entropy_coef=0.01, use_tis=True, vocab_size=12, reduction=reduction)
    loss, metrics = micro_batch_loss(logits, packed, samples, config, num_tokens=4.0, num_sequences=2)
    assert loss.device.type == "meta" and {m.device.type for m in metrics.values()} == {"meta"}
    assert set(metrics) >= {"tis_weight_mean", "pg_loss", "kl_loss", "entropy", "train_rollout_logprob_abs_diff"}
    loss.backward()
    assert logits.grad.device.type == "meta"
    rows, targets = response_logits_and_targets(logits, packed)
    assert targets.device.type == "meta"
    assert token_log_probs(rows, targets, 0.7, vocab_size=12).device.type == "meta"
    assert entropy(rows, 0.7, vocab_size=12).device.type == "meta"


def test_the_general_importance_weights_follow_the_logits_device():
    from slime_search.algo import ISConfig
    from slime_search.backends.megatron.loss import local_mis_stats

    samples = complete_batch()
    packed = pack([s.tokens for s in samples], [s.response_length for s in samples])
    logits = torch.empty(1, packed.num_tokens, 16, device="meta", requires_grad=True)
    mis = ISConfig(level="geometric", mode="mask", rejection=True, veto_threshold=1e-4, batch_normalize=True)
    normalizer = local_mis_stats(samples, mis, torch.device("meta")).float()
    config = LossConfig(mis=mis, vocab_size=12)
    loss, metrics = micro_batch_loss(logits, packed, samples, config, 4.0, 2, is_normalizer=normalizer)
    assert loss.device.type == "meta" and {m.device.type for m in metrics.values()} == {"meta"}


def test_tensors_reduced_over_the_data_parallel_group_follow_the_model_device():
    """NCCL reduces only tensors on the GPU: the counts and MIS statistics a rank all-reduces are built on the model's
    device, whatever device the batch arrived on."""
    from slime_search.algo import ISConfig
    from slime_search.backends.megatron.loss import local_batch_counts, local_mis_stats

    samples = complete_batch()
    meta = torch.device("meta")
    assert local_batch_counts(samples, meta).device == meta
    assert local_batch_counts(samples, torch.device("cpu")).tolist() == [4.0, 2.0]
    for level in ("token", "sequence"):
        stats = local_mis_stats(samples, ISConfig(level=level), meta)
        assert stats.device == meta and stats.shape == (2,)
    assert local_mis_stats(samples, ISConfig(), torch.device("cpu"))[1].item() == 4.0  # one weight per loss token


def test_packs_pad_to_the_tensor_parallel_multiple_outside_the_loss():
    samples = complete_batch()
    tokens, responses = [s.tokens for s in samples], [s.response_length for s in samples]
    plain, padded = pack(tokens, responses), pack(tokens, responses, multiple=4)
    assert (plain.num_tokens, padded.num_tokens, padded.padding) == (9, 12, 3)  # sequence parallelism splits 12 by 4
    assert padded.cu_seqlens.tolist() == [0, 5, 9, 12] and padded.segment_lengths == [5, 4, 3]
    assert padded.position_ids[0, 9:].tolist() == [0, 1, 2] and padded.response_slices() == plain.response_slices()
    allowed = ~padded.attention_mask()[0, 0]
    assert not allowed[9:, :9].any() and not allowed[:9, 9:].any()  # the padding is a segment of its own
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 12, 16, generator=gen, requires_grad=True)
    config = LossConfig(kl_coef=0.1, use_tis=True, vocab_size=16)
    loss_padded, _ = micro_batch_loss(logits, padded, samples, config, 4.0, 2)
    loss_plain, _ = micro_batch_loss(logits[:, :9], plain, samples, config, 4.0, 2)
    assert loss_padded.item() == pytest.approx(loss_plain.item(), abs=1e-6)
    loss_padded.backward()
    assert logits.grad[0, 9:].abs().sum() == 0  # nothing of the padding reaches the loss
    assert pack(tokens, responses, multiple=3).padding == 0  # 9 already divides


def test_a_bf16_model_gets_megatrons_mixed_precision_optimizer():
    from slime_search.backends.megatron.optimizer import OptimConfig, megatron_optimizer_config

    bf16 = megatron_optimizer_config(OptimConfig(lr=1e-6), torch.bfloat16)
    # Megatron builds its mixed-precision optimizer (fp32 main weights) when bf16 is set, FP32Optimizer otherwise
    assert bf16.bf16 and not bf16.fp16 and bf16.params_dtype == torch.bfloat16
    assert bf16.main_params_dtype == torch.float32
    fp32 = megatron_optimizer_config(OptimConfig(), torch.float32)
    assert not (fp32.bf16 or fp32.fp16) and fp32.params_dtype == torch.float32


class FakeModel:
    """What Layout reads of a GPTModel: its config, a parameter, its state-dict names, its modules."""

    def __init__(self, names: list[str], tp: int, sequence_parallel: bool, modules: tuple = ()):
        from types import SimpleNamespace

        self.config = SimpleNamespace(tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel)
        self.names = names
        self.submodules = modules

    def parameters(self):
        return iter([torch.zeros(1)])

    def state_dict(self):
        return dict.fromkeys(self.names)

    def modules(self):
        return iter(self.submodules)


def test_layout_uses_thd_only_with_a_packed_attention_and_pads_only_for_sequence_parallel():
    from slime_search.backends.megatron.actor import Layout
    from slime_search.backends.megatron.packed_attention import PackedAttention

    te = ["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"]
    local = ["decoder.layers.0.input_layernorm.weight"]
    assert Layout.of(FakeModel(te, tp=2, sequence_parallel=True)) == Layout(torch.device("cpu"), True, 2)
    # Megatron's local attention refuses packed sequence parameters: the mask path
    assert Layout.of(FakeModel(local, tp=2, sequence_parallel=False)) == Layout(torch.device("cpu"), False, 1)
    # the local spec with the packed attention (the default without TransformerEngine) takes them
    packed = PackedAttention.__new__(PackedAttention)  # the layout asks its type only
    with_packed = FakeModel(local, tp=2, sequence_parallel=False, modules=(packed,))
    assert Layout.of(with_packed) == Layout(torch.device("cpu"), True, 1)


def test_health_metrics_of_the_loss_split_clipping_and_truncation():
    """Clip fractions by side, the share of TIS weights the cap truncated, and the entropy without an entropy term.
    Leaf logits give the trainer's log-probs; old and rollout log-probs are set against them to chosen ratios."""
    samples, packed, logits = make_batch()
    rows, targets = response_logits_and_targets(logits.detach(), packed)
    lp = torch.log_softmax(rows, -1).gather(-1, targets[:, None]).squeeze(-1)
    # tokens (mask 1): s1 t0, s1 t3 (A = +1), s2 t0, s2 t1 (A = -0.5). ratio = exp(lp - old):
    # s1 t0 ratio 1.5 > 1.28 with A > 0 -> clipped high; s1 t3 ratio 1.0 -> not clipped;
    # s2 t0 ratio 0.5 < 0.8 with A < 0 -> clipped low; s2 t1 ratio 4.0, A < 0 -> unclipped (the larger loss), and
    # with dual clip c = 3 the bound -A*c is active there.
    log_ratio = torch.log(torch.tensor([1.5, 1.0, 1.0, 1.0, 0.5, 4.0]))
    old = (lp - log_ratio).tolist()
    samples[0].old_log_probs, samples[1].old_log_probs = old[:4], old[4:]
    # rollout log-probs: the engine 1 nat below the trainer's old ones on s1 t0 (w = e > cap 2: truncated), equal
    # elsewhere (w = 1)
    rollout = list(old)
    rollout[0] -= 1.0
    samples[0].rollout_log_probs, samples[1].rollout_log_probs = rollout[:4], rollout[4:]
    config = LossConfig(use_tis=True, tis_cap=2.0, eps_clip_c=3.0, reduction="token_mean")
    _, metrics = micro_batch_loss(logits, packed, samples, config, num_tokens=4, num_sequences=2)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 4)
    assert metrics["pg_clipfrac_high"].item() == pytest.approx(1 / 4)
    assert metrics["pg_clipfrac_low"].item() == pytest.approx(1 / 4)
    assert metrics["pg_clipfrac_dual"].item() == pytest.approx(1 / 4)
    assert metrics["tis_clipfrac"].item() == pytest.approx(1 / 4)
    assert metrics["tis_weight_mean"].item() == pytest.approx((2.0 + 1 + 1 + 1) / 4)
    assert metrics["train_rollout_logprob_abs_diff"].item() == pytest.approx(1 / 4)
    p = torch.softmax(rows, -1)
    token_entropy = -(p * p.log()).sum(-1)
    trained = torch.tensor([1.0, 0, 0, 1, 1, 1])
    assert metrics["entropy"].item() == pytest.approx(((token_entropy * trained).sum() / 4).item(), rel=1e-5)
    assert metrics["nonfinite_log_probs"].item() == 0


def test_the_likelihood_preserving_term_enters_the_loss_only_when_asked():
    samples, packed, logits = make_batch()
    rows, targets = response_logits_and_targets(logits.detach(), packed)
    lp = torch.log_softmax(rows, -1).gather(-1, targets[:, None]).squeeze(-1)
    old = lp.clone()
    old[:4] += 0.3  # sample 1 lost 0.3 nats a token since the old policy; sample 2 gained 0.1
    old[4:] -= 0.1
    samples[0].old_log_probs, samples[1].old_log_probs = old[:4].tolist(), old[4:].tolist()
    base, _ = micro_batch_loss(logits, packed, samples, LossConfig(reduction="token_mean"), 4, 2)
    config = LossConfig(reduction="token_mean", llds_coef=2.0)
    loss, metrics = micro_batch_loss(logits, packed, samples, config, num_tokens=4, num_sequences=2)
    # sample 1's two loss tokens fell by 0.3 each: (0.3 + 0.3) / 4 tokens = 0.15; sample 2 rose: nothing
    assert metrics["llds_penalty"].item() == pytest.approx(0.15, abs=1e-6)
    assert loss.item() == pytest.approx(base.item() + 2.0 * 0.15, abs=1e-5)


def test_the_post_update_probe_takes_rewarded_and_penalised_samples_first_within_its_budget():
    from slime_search.backends.megatron.actor import probe_samples

    def sample(advantage, length=10):
        return TrainSample([0] * length, 2, [1, 1], advantage, old_log_probs=[-1.0, -1.0])

    zero, up, down, up2 = sample(0.0), sample(1.0), sample(-1.0), sample(0.5)
    assert probe_samples([zero, up, down, up2], budget=30) == [up, down, up2]
    assert probe_samples([zero, up, down, up2], budget=35) == [up, down, up2]  # a fourth would pass the budget
    assert probe_samples([zero], budget=5) == [zero]  # at least one
    assert probe_samples([up], budget=0) == []
    assert probe_samples([TrainSample([0, 1], 1, [1], 1.0)], budget=10) == []  # no old log-probs: nothing to compare


def test_the_policy_shift_of_an_update_is_k3_kl_and_the_log_prob_change_by_advantage_sign():
    import math

    from slime_search.backends.megatron.actor import policy_shift_metrics, policy_shift_sums

    up = TrainSample([0, 1, 2, 3], 3, [1, 0, 1], 1.0, old_log_probs=[-1.0, -1.0, -2.0])
    down = TrainSample([0, 1], 1, [1], -1.0, old_log_probs=[-0.5])
    # new log-probs: up's loss tokens change by +0.2 and -0.4 (the masked one by +5, ignored); down's by -0.3
    sums = policy_shift_sums([up, down], [[-0.8, 4.0, -2.4], [-0.8]])
    out = policy_shift_metrics(sums)
    k3 = lambda x: math.exp(x) - 1 - x  # noqa: E731
    assert out["kl_old_new"] == pytest.approx((k3(0.2) + k3(-0.4) + k3(-0.3)) / 3)
    assert out["logp_shift_pos"] == pytest.approx((0.2 - 0.4) / 2)
    assert out["logp_shift_neg"] == pytest.approx(-0.3)
    assert "logp_shift_neg" not in policy_shift_metrics(policy_shift_sums([up], [[-0.8, 4.0, -2.4]]))
