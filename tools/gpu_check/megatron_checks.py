"""The Megatron actor's device path checked against Hugging Face on the tiny Qwen2 / Qwen3, one JSON line per check.

    python -m tools.gpu_check.megatron_checks            # on a CUDA GPU; on CPU it prints the same checks there

Every model gets the HF checkpoint's weights, so runs on two devices compare number for number:
- parity: Megatron GPTModel logits against HF's on the same device and dtype (fp32, bf16);
- log_probs: the actor's packed log-probs (four samples in one row) against HF run on each sample alone;
- train: GRPO steps on a fixed batch, fp32 and bf16 (loss, grad norm, whether applied);
- offload: --colocate's hand-over after a step: bytes, device memory before and after, bit-exact return, and the
  next step after it;
- gather: the weights streamed back to HF names after training, against HF's own state dict before training
  (a weight push must send exactly what the actor holds: before any step they are the checkpoint's);
- attention: the packed attention (--attention-impl packed, THD) against Megatron's local attention over the packed
  row's block-diagonal mask, same weights: logits, response log-probs and every parameter's gradient.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def fixed_batch(seed: int = 7):
    import torch

    from slime_search.types import TrainSample

    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i, (prompt, response) in enumerate([(5, 7), (3, 9), (8, 4), (4, 6)]):
        tokens = torch.randint(0, 150_000, (prompt + response,), generator=gen).tolist()
        mask = [1] * response
        mask[1:3] = [0, 0]  # an observation inside the response
        samples.append(TrainSample(tokens, response, mask, advantage=[1.0, -1.0, 0.5, -0.5][i]))
    return samples


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def load_pair(checkpoint: Path, dtype, device):
    """HF's model and a Megatron GPTModel holding the same weights, both on `device` in `dtype`."""
    from transformers import AutoModelForCausalLM

    from megatron_bridge import ModelShape
    from slime_search.backends.megatron.model import ModelOptions, build_gpt_model, load_hf_weights

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
    shape = ModelShape.from_hf_config(hf.config)
    options = ModelOptions.from_hf_config(hf.config, params_dtype=dtype)
    model = build_gpt_model(shape, options).to(device)
    load_hf_weights(model, {k: v.float().cpu() for k, v in hf.state_dict().items()}, shape, options)
    return hf, model, shape


def check_parity(checkpoint: Path, family: str, dtype, device) -> None:
    import torch

    from slime_search.backends.megatron import cpu_compat

    hf, model, shape = load_pair(checkpoint, dtype, device)
    ids = torch.randint(0, 151_000, (2, 64), generator=torch.Generator().manual_seed(1)).to(device)
    positions = torch.arange(64, device=device).expand_as(ids)
    with torch.no_grad():
        ours = model.eval()(ids, positions, attention_mask=cpu_compat.causal_mask(64).to(device))
        reference = hf(ids).logits
    difference = (ours[..., : shape.vocab_size].float() - reference.float()).abs()
    emit(
        {
            "check": "parity",
            "family": family,
            "dtype": str(dtype),
            "max_abs_logit_diff": difference.max().item(),
            "mean_abs_logit_diff": difference.mean().item(),
            "logit_scale": reference.float().abs().mean().item(),
        }
    )


def actor_config(shape, lr: float = 1e-4):
    from slime_search.backends.megatron.actor import ActorConfig
    from slime_search.backends.megatron.loss import LossConfig
    from slime_search.backends.megatron.optimizer import OptimConfig

    return ActorConfig(
        loss=LossConfig(eps_clip=0.2, eps_clip_high=0.28, vocab_size=shape.vocab_size),
        optim=OptimConfig(lr=lr, clip_grad=1.0),
        max_tokens_per_micro_batch=64,  # the four samples in one packed row
    )


def hf_response_log_probs(hf, sample, device) -> list[float]:
    import torch

    with torch.no_grad():
        log_probs = torch.log_softmax(hf(torch.tensor([sample.tokens], device=device)).logits[0].float(), -1)
    start = len(sample.tokens) - sample.response_length
    return [log_probs[start + i - 1, t].item() for i, t in enumerate(sample.tokens[start:])]


def check_training(checkpoint: Path, family: str, dtype, device) -> None:
    """Log-probs against HF, GRPO steps, the colocated hand-over and the weight gather on one actor."""
    import torch

    from benchmarks.harness.handover import handover
    from slime_search.backends.megatron.actor import MegatronActor
    from slime_search.weight_sync.gather import iter_hf_buckets

    hf, model, shape = load_pair(checkpoint, dtype, device)
    actor = MegatronActor(model, actor_config(shape))
    samples = fixed_batch()
    gathered = dict(
        pair for bucket in iter_hf_buckets(actor.local_state_dict(), shape, False, 1 << 20) for pair in bucket
    )
    hf_state = hf.state_dict()
    # a tied head is HF's embedding again and is not pushed
    not_sent = sorted(set(hf_state) - set(gathered))
    gather_diff = max((gathered[name].float() - hf_state[name].float()).abs().max().item() for name in gathered)
    emit(
        {
            "check": "gather",
            "family": family,
            "dtype": str(dtype),
            "tensors": len(gathered),
            "hf_tensors_not_sent": not_sent,
            "max_abs_diff": gather_diff,
        }
    )
    old = actor.compute_log_probs(samples)
    expected = [hf_response_log_probs(hf, s, device) for s in samples]
    lp_diff = max(abs(a - b) for got, want in zip(old, expected, strict=True) for a, b in zip(got, want, strict=True))
    emit({"check": "log_probs", "family": family, "dtype": str(dtype), "max_abs_diff_vs_hf": lp_diff})
    for sample, lp in zip(samples, old, strict=True):
        sample.old_log_probs = lp
    history = [actor.train_step(samples) for _ in range(3)]
    before_params = [p.detach().clone() for p in actor.model.parameters()]
    offload = handover(actor)  # on CPU the device-memory figures read 0
    offload["bit_exact_after_onload"] = all(
        torch.equal(a, b) for a, b in zip(before_params, actor.model.parameters(), strict=True)
    )
    history.append(actor.train_step(samples))
    keys = ("loss", "grad_norm", "step_applied", "kl_old_new")
    emit(
        {
            "check": "train",
            "family": family,
            "dtype": str(dtype),
            "steps": [{k: h.get(k) for k in keys} for h in history],
            "offload": offload,
        }
    )


def check_attention(checkpoint: Path, family: str, dtype, device) -> None:
    """PackedAttention against the local spec's DotProductAttention on the same packed row (the four samples and a
    padding segment): max abs differences of logits, log-probs and gradients, and the gradients' scale."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_bridge import ModelShape
    from slime_search.backends.megatron.actor import Layout, _forward
    from slime_search.backends.megatron.logprobs import token_log_probs
    from slime_search.backends.megatron.loss import response_logits_and_targets
    from slime_search.backends.megatron.model import ModelOptions, build_gpt_model, load_hf_weights
    from slime_search.backends.megatron.packing import pack

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    shape = ModelShape.from_hf_config(hf.config)
    samples = fixed_batch()
    packed = pack([s.tokens for s in samples], [s.response_length for s in samples], multiple=16)
    results = {}
    for impl in ("local", "packed"):
        options = ModelOptions.from_hf_config(hf.config, params_dtype=dtype, attention_impl=impl)
        model = build_gpt_model(shape, options)
        load_hf_weights(model, hf.state_dict(), shape, options)
        model = model.to(device)
        logits = _forward(model, packed, Layout.of(model))
        rows, targets = response_logits_and_targets(logits, packed)
        log_probs = token_log_probs(rows.float(), targets, 1.0, shape.vocab_size)
        weights = torch.linspace(-1.0, 1.0, log_probs.numel(), device=log_probs.device)
        (log_probs * weights).sum().backward()
        grads = {name: param.grad.float() for name, param in model.named_parameters()}
        results[impl] = (logits.detach().float(), log_probs.detach(), grads)
    (logits_l, lp_l, grads_l), (logits_p, lp_p, grads_p) = results["local"], results["packed"]
    emit(
        {
            "check": "attention",
            "family": family,
            "dtype": str(dtype),
            "max_abs_logit_diff": (logits_p - logits_l).abs().max().item(),
            "max_abs_log_prob_diff": (lp_p - lp_l).abs().max().item(),
            "max_abs_grad_diff": max((grads_p[n] - g).abs().max().item() for n, g in grads_l.items()),
            "max_abs_grad": max(g.abs().max().item() for g in grads_l.values()),
        }
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="qwen2,qwen3")
    args = parser.parse_args(argv)

    import torch

    from slime_search.backends.megatron.distributed import init_megatron, shutdown
    from slime_search.models.tiny_qwen import TinyQwenConfig, save_tiny_checkpoint
    from slime_search.utils.net import free_port

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    init_megatron(0, 1, tp_size=1, master_port=free_port())
    from slime_search.backends.megatron.model import fused_softmax_kernels_available, te_available

    emit(
        {
            "check": "environment",
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "transformer_engine": te_available(),
            "fused_softmax_kernels": fused_softmax_kernels_available(),
        }
    )
    dtypes = [torch.float32, torch.bfloat16] if device.type == "cuda" else [torch.float32]
    with tempfile.TemporaryDirectory() as tmp:
        for family in filter(None, args.families.split(",")):  # none: the environment alone
            checkpoint = save_tiny_checkpoint(Path(tmp) / family, TinyQwenConfig(family=family))
            for dtype in dtypes:
                for check in (check_parity, check_training, check_attention):
                    try:
                        check(checkpoint, family, dtype, device)
                    except Exception as error:  # one broken path must not hide what the others show
                        emit(
                            {
                                "check": check.__name__,
                                "family": family,
                                "dtype": str(dtype),
                                "error": f"{type(error).__name__}: {error}"[:2000],
                            }
                        )
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
