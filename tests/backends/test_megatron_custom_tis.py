"""--custom-tis-function-path in the policy loss, with slime's semantics: the function weights the per-token policy loss,
the tokens its masks take out leave the loss (every term: the sums lose them, the per-sequence and per-token counts
stay those of the loss mask), its metrics are reduced over the tokens before rejection; slime's own
mis.compute_mis_weights_with_cp (../shared) runs in it unchanged; the flags refuse what cannot work; under Ray the
function loads in each rank and its metrics are the whole batch's at data-parallel size 2."""

from __future__ import annotations

import math
import pickle
from argparse import Namespace
from pathlib import Path

import pytest
import torch
import yaml

from slime_search.backends.megatron.custom_tis import CustomTIS
from slime_search.backends.megatron.loss import LossConfig, micro_batch_loss, response_logits_and_targets
from slime_search.backends.megatron.packing import pack
from slime_search.types import TrainSample
from tests.compat.conftest import MIS, require_slime_files
from tests.test_arguments import parse, usage_error

FUNCTION = f"{__name__}.truncate_and_reject"
SLIME_MIS = "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp"


def truncate_and_reject(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """A slime-style TIS function: weights exp(old - rollout) truncated at args.cap, tokens whose ratio is above
    args.reject leave the loss; the weights as a metric. It imports slime's CP helpers as slime's mis.py does (served
    by slime_search.compat where slime is not installed)."""
    from slime.backends.megatron_utils.cp_utils import all_gather_with_cp

    ratios = [
        torch.exp(all_gather_with_cp(t, n, len(t)) - r)
        for t, r, n in zip(train_log_probs, rollout_log_probs, kwargs["total_lengths"], strict=True)
    ]
    weights = torch.cat([r.clamp(max=args.cap) for r in ratios])
    masks = [m * (r <= args.reject) for m, r in zip(loss_masks, ratios, strict=True)]
    return pg_loss * weights, masks, {"custom_weight": weights}


SETTINGS = Namespace(cap=2.0, reject=3.0)


def batch(ratios: list[list[float]], masks: list[list[int]], advantages: list[float], seed: int = 0):
    """Samples whose old log-probs are the logits' own (the PPO ratio is 1, each token's policy loss is -A) and whose
    engine log-probs sit log(ratio) below them; their packed row and logits."""
    gen = torch.Generator().manual_seed(seed)
    samples = [
        TrainSample(list(range(1, 4 + len(r))), len(r), m, a) for r, m, a in zip(ratios, masks, advantages, strict=True)
    ]
    packed = pack([s.tokens for s in samples], [s.response_length for s in samples])
    logits = torch.randn(1, packed.num_tokens, 12, generator=gen, requires_grad=True)
    rows, targets = response_logits_and_targets(logits.detach(), packed)
    own = torch.log_softmax(rows, -1).gather(-1, targets[:, None]).squeeze(-1).split(packed.response_lengths)
    for sample, old, r in zip(samples, own, ratios, strict=True):
        sample.old_log_probs = old.tolist()
        sample.ref_log_probs = (old - 0.1).tolist()
        sample.rollout_log_probs = [o - math.log(x) for o, x in zip(old.tolist(), r, strict=True)]
    return samples, packed, logits


def loaded():
    """The function as the actor loads it: by its path, slime's modules served to it (slime is not installed)."""
    return CustomTIS(FUNCTION, SETTINGS).load()


def with_function(**loss) -> LossConfig:
    return LossConfig(custom_tis=CustomTIS(FUNCTION, SETTINGS), **loss)


# Sample 1: ratios 1.5, 1, 1, 4 with its middle tokens masked out, A = 1 -> weights 1.5, _, _, 2; its last token is
# rejected (4 > 3). Sample 2: ratios 0.5, 1, 1, A = -0.5 -> weights 0.5, 1, 1, none rejected.
RATIOS, MASKS, ADVANTAGES = [[1.5, 1.0, 1.0, 4.0], [0.5, 1.0, 1.0]], [[1, 0, 0, 1], [1, 1, 1]], [1.0, -0.5]


@pytest.mark.parametrize(
    ("reduction", "pg_loss", "weight_metric"),
    [
        # per sequence: (-1 x 1.5) / 2 loss tokens = -0.75 and 0.5 x (0.5 + 1 + 1) / 3 = 0.41667, over 2 sequences;
        # the weights before rejection: (1.5 + 2) / 2 = 1.75 and (0.5 + 1 + 1) / 3, over 2 sequences
        ("sequence_mean", (-0.75 + 1.25 / 3) / 2, (1.75 + 2.5 / 3) / 2),
        # per token: (-1.5 + 0.25 + 0.5 + 0.5) / 5 loss tokens; the weights (1.5 + 2 + 0.5 + 1 + 1) / 5
        ("token_mean", -0.25 / 5, 6.0 / 5),
    ],
)
def test_the_function_weights_the_policy_loss_and_its_rejected_tokens_leave_it(reduction, pg_loss, weight_metric):
    samples, packed, logits = batch(RATIOS, MASKS, ADVANTAGES)
    config = with_function(reduction=reduction)
    loss, metrics = micro_batch_loss(logits, packed, samples, config, 5, 2, tis_function=loaded())
    assert loss.item() == pytest.approx(pg_loss, abs=1e-6) and metrics["pg_loss"].item() == pytest.approx(
        pg_loss, abs=1e-6
    )
    assert metrics["custom_weight"].item() == pytest.approx(weight_metric, abs=1e-6)
    assert metrics["ois"].item() == pytest.approx(1.0, abs=1e-6)  # the ratio to the old policy, slime's "ois"
    assert "tis_weight_mean" not in metrics  # vanilla TIS is not applied as well
    loss.backward()
    # rows 2..5 predict sample 1's response, rows 9..11 sample 2's: the masked rows 3, 4 and the rejected row 5 get
    # no gradient, the others do
    trained = logits.grad[0].abs().sum(-1) > 0
    assert [row for row in range(packed.num_tokens) if trained[row]] == [2, 9, 10, 11]


def test_a_rejected_token_leaves_the_kl_and_entropy_terms_too():
    """slime rebuilds its reducer with the function's masks for every term after it: the KL to the reference and the
    entropy bonus lose the rejected token as the policy loss does."""
    samples, packed, logits = batch(RATIOS, MASKS, ADVANTAGES)
    config = with_function(kl_coef=0.5, entropy_coef=0.1)
    loss, metrics = micro_batch_loss(logits, packed, samples, config, 5, 2, tis_function=loaded())
    loss.backward()
    assert logits.grad[0, 5].abs().sum() == 0 and logits.grad[0, 2].abs().sum() > 0
    # the KL of the kept tokens: 0.1 each (reference 0.1 below the policy), low_var_kl = e^-0.1 - 1 + 0.1, over
    # sample 1's 2 loss tokens (1 kept) and sample 2's 3, over 2 sequences
    k3 = math.exp(-0.1) - 1 + 0.1
    assert metrics["kl_loss"].item() == pytest.approx((k3 / 2 + k3) / 2, rel=1e-5)


def test_without_a_rejection_the_loss_is_vanilla_tis():
    """A function that truncates at --tis-clip and rejects nothing gives vanilla TIS's loss."""
    samples, packed, logits = batch([[1.5, 2.5, 1.0, 0.5], [0.5, 1.0, 4.0]], MASKS, ADVANTAGES)
    config = LossConfig(custom_tis=CustomTIS(FUNCTION, Namespace(cap=2.0, reject=math.inf)))
    custom, _ = micro_batch_loss(logits, packed, samples, config, 5, 2, tis_function=loaded())
    vanilla, _ = micro_batch_loss(logits, packed, samples, LossConfig(use_tis=True, tis_cap=2.0), 5, 2)
    assert custom.item() == pytest.approx(vanilla.item(), abs=1e-7)


def slime_examples_root(folder: Path) -> Path:
    """A folder holding only slime's examples/ (a link to ../shared's): on the path, `examples.train_infer_mismatch_
    helper` imports from it, and `slime` still comes from slime_search.compat. (The root of ../shared's partial copy of
    slime on the path would shadow it: its `slime` folder, without slime.backends, is found before the compat layer.)
    Beside this repository's examples/ folder: neither has an __init__.py, so both are portions of one namespace
    package `examples`."""
    root = folder / "slime_examples"
    root.mkdir(exist_ok=True)
    if not (root / "examples").exists():
        (root / "examples").symlink_to(require_slime_files() / "examples", target_is_directory=True)
    return root


def test_slimes_mis_helper_runs_in_the_loss_with_mis_yaml(monkeypatch, tmp_path):
    """slime's mis.compute_mis_weights_with_cp, loaded by its dotted path (slime_examples_root), with mis.yaml's
    settings: token TIS truncated at 2, token rejection outside [0.5, 2], weights normalised to mean 1 over the
    micro-batch.

    Ratios: sample 1 [1.5, 3.0], A = 1; sample 2 [0.4, 1.0, 1.0] with its middle token masked, A = -0.5.
      weights  [1.5, 2.0], [0.4, _, 1.0] / 1.225 (their mean over the 4 loss tokens)
      kept     [1, 0] (3 > 2), [0, _, 1] (0.4 < 0.5)
      loss     ((-1 x 1.5 / 1.225) / 2 + (0.5 x 1.0 / 1.225) / 2) / 2
    """
    monkeypatch.syspath_prepend(str(slime_examples_root(tmp_path)))
    args = Namespace(**yaml.safe_load((MIS / "mis.yaml").read_text()))
    config = LossConfig(custom_tis=CustomTIS(SLIME_MIS, args))
    function = config.custom_tis.load()
    samples, packed, logits = batch([[1.5, 3.0], [0.4, 1.0, 1.0]], [[1, 1], [1, 0, 1]], ADVANTAGES)
    loss, metrics = micro_batch_loss(logits, packed, samples, config, 4, 2, tis_function=function)
    assert loss.item() == pytest.approx(((-1.5 / 1.225) / 2 + (0.5 / 1.225) / 2) / 2, abs=1e-6)
    # over the tokens before rejection: sample 1 truncated 1 of 2, sample 2 none; sample 2 rejected 1 of 2 below
    assert metrics["mis_tis_truncate_fraction"].item() == pytest.approx((1 / 2 + 0) / 2)
    assert metrics["mis_rs_mask_fraction_low"].item() == pytest.approx((0 + 1 / 2) / 2)
    assert metrics["mis_batch_norm_factor"].item() == pytest.approx(1.225)
    assert {"mis_kl", "mis_k3_kl", "mis_chi2_token", "mis_is_ratio_mean_final", "ois"} <= set(metrics)
    loss.backward()
    # the rows predicting the rejected tokens (sample 1's second, sample 2's first) get no gradient
    trained = logits.grad[0].abs().sum(-1) > 0
    assert [row for row in range(packed.num_tokens) if trained[row]] == [2, 9]


def test_an_answer_that_does_not_fit_is_an_error_naming_the_function():
    samples, packed, logits = batch(RATIOS, MASKS, ADVANTAGES)
    config = with_function()

    def short_loss(args, *, pg_loss, loss_masks, **kwargs):
        return pg_loss[:-1], loss_masks, {}

    def named_as_the_loss(args, *, pg_loss, loss_masks, **kwargs):
        return pg_loss, loss_masks, {"entropy": torch.zeros_like(pg_loss)}

    with pytest.raises(ValueError, match=r"short_loss returned pg_loss of shape \(6,\), expected \(7,\)"):
        micro_batch_loss(logits, packed, samples, config, 5, 2, tis_function=short_loss)
    with pytest.raises(ValueError, match=r"returned metrics \['entropy'\]: names the loss reports itself"):
        micro_batch_loss(logits, packed, samples, config, 5, 2, tis_function=named_as_the_loss)
    with pytest.raises(ValueError, match="pass both or neither"):
        micro_batch_loss(logits, packed, samples, config, 5, 2)
    for other in (dict(use_tis=True), dict(loss_type="sft")):
        with pytest.raises(ValueError, match="takes the place of vanilla TIS and MIS"):
            with_function(**other)


# ---- the flags ------------------------------------------------------------------------------------------------------


def test_the_flag_reaches_the_loss_with_the_flags_and_replaces_vanilla_tis():
    from slime_search.run.config import actor_config

    args = parse("--use-tis", "--tis-clip-low", "0.5", "--custom-tis-function-path", FUNCTION)
    config = actor_config(args, vocab_size=100)
    assert config.loss.custom_tis == CustomTIS(FUNCTION, args)
    assert (config.loss.use_tis, config.loss.mis) == (False, None)
    assert pickle.loads(pickle.dumps(config)).loss.custom_tis.load() is truncate_and_reject  # as a Ray actor gets it
    assert actor_config(parse("--use-tis"), vocab_size=100).loss.custom_tis is None


def test_combinations_that_cannot_work_are_usage_errors(capsys):
    assert "add --use-tis (slime's mis.yaml sets use_tis: true" in usage_error(
        capsys, "--custom-tis-function-path", FUNCTION
    )
    assert "not both" in usage_error(capsys, "--use-tis", "--use-mis", "--custom-tis-function-path", FUNCTION)
    sft = ["--use-tis", "--loss-type", "sft", "--custom-tis-function-path", FUNCTION]
    assert "use --loss-type policy_loss" in usage_error(capsys, *sft)
    missing = usage_error(capsys, "--use-tis", "--custom-tis-function-path", "no_such_module.fn")
    assert "cannot load 'no_such_module.fn': module 'no_such_module' not found" in missing
    assert "has no attribute 'nothing'" in usage_error(
        capsys, "--use-tis", "--custom-tis-function-path", f"{__name__}.nothing"
    )


# ---- under Ray ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_each_rank_loads_the_function_and_its_metrics_are_the_whole_batchs(ray_session, tiny_checkpoint):
    """Two data-parallel ranks (Megatron on CPU over gloo, Ray actors): the function, loaded by its path in each rank's
    process, weights the first step's loss, and its metric is of the whole batch as the driver computes it."""
    from slime_search.algo import reduce_loss
    from slime_search.backends.megatron.actor import ActorConfig
    from slime_search.backends.megatron.optimizer import OptimConfig
    from slime_search.ray.train_group import ModelSource, RayTrainGroup, TrainGroupConfig
    from tests.backends.test_megatron_train import fixed_batch

    group = RayTrainGroup(TrainGroupConfig(num_ranks=2))
    try:
        loss = LossConfig(vocab_size=151936, custom_tis=CustomTIS(FUNCTION, SETTINGS))
        group.load_models(ModelSource(str(tiny_checkpoint)), ActorConfig(loss=loss, optim=OptimConfig(lr=1e-3)))
        samples = fixed_batch()
        group.prepare(samples)  # the old log-probs
        for i, sample in enumerate(samples):  # ratios 4 (rejected), 2.5 (truncated at 2), 1, 0.5 ... by token
            sample.rollout_log_probs = [
                o - math.log((4.0, 2.5, 1.0, 0.5)[(i + t) % 4]) for t, o in enumerate(sample.old_log_probs)
            ]
        metrics = group.optimize(samples, steps=1)
    finally:
        group.shutdown()
    old = torch.tensor([x for s in samples for x in s.old_log_probs])
    rollout = torch.tensor([x for s in samples for x in s.rollout_log_probs])
    mask = torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.float32)
    lengths = [s.response_length for s in samples]
    ratios = torch.exp(old - rollout)
    weights, kept = ratios.clamp(max=2.0), (ratios <= 3.0).float()
    advantages = torch.cat([torch.full((s.response_length,), s.advantage) for s in samples])
    # the first step is on-policy: each token's policy loss is -A, weighted; the rejected tokens leave the sums
    expected_loss = reduce_loss(-advantages * weights * kept, mask, lengths, "sequence_mean")
    assert metrics["train/pg_loss"] == pytest.approx(float(expected_loss), abs=1e-5)
    assert metrics["train/custom_weight"] == pytest.approx(float(reduce_loss(weights, mask, lengths, "sequence_mean")))
    assert metrics["train/ois"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["train/steps_applied"] == 1.0
