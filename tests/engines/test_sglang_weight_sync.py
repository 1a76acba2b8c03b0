"""Weight sync into a real SGLang engine (GPU only): NCCL broadcast between GPUs, and CUDA IPC handles plus the
memory hand-over for an engine on the trainer's own GPU. The same protocol runs against the CPU engine in
tests/weight_sync/test_broadcast_and_tensor_handles.py on every machine."""

import importlib.util

import httpx
import pytest

from slime_search.utils.net import free_port
from slime_search.weight_sync.transport_base import weight_update_session

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1200)]
PROMPT = [151644, 872, 198, 9707, 1879, 0, 151645, 198, 151644, 77091, 198]


def needs_gpus(count: int):
    torch = pytest.importorskip("torch")
    if importlib.util.find_spec("sglang") is None or torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} CUDA GPU(s) with SGLang installed (pip install -e '.[gpu]')")


def perturbed_on_gpu(checkpoint):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).cuda().eval()
    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator, device="cuda"))
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    return model, state


def engine_log_probs_match(url: str, model) -> None:
    import torch

    out = httpx.post(
        f"{url}/generate",
        json={
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0},
            "return_logprob": True,
        },
        timeout=120,
    ).json()
    tokens = PROMPT + out["output_ids"]
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([tokens], device="cuda")).logits[0].float(), -1)
    expected = [lp[len(PROMPT) + i - 1, t].item() for i, t in enumerate(out["output_ids"])]
    served = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
    assert served == pytest.approx(expected, abs=0.05)  # SGLang computes in its own dtype and kernels


def launch_engine(checkpoint, gpu: int, *extra: str):
    from slime_search.engines.sglang_launch import SGLangEngineSpec, launch

    spec = SGLangEngineSpec(
        str(checkpoint),
        port=free_port(),
        base_gpu_id=gpu,
        mem_fraction_static=0.3,
        extra_args=("--dtype", "float32", *extra),
    )
    return launch([spec], "127.0.0.1", 0), spec.url


def test_nccl_broadcast_to_an_engine_on_another_gpu(tiny_checkpoint):
    needs_gpus(2)
    from slime_search.weight_sync.broadcast import BroadcastConfig, WeightBroadcaster

    model, state = perturbed_on_gpu(tiny_checkpoint)  # the "trainer" on GPU 0, the engine on GPU 1
    deployment, url = launch_engine(tiny_checkpoint, 1)
    try:
        broadcaster = WeightBroadcaster(BroadcastConfig("nccl", bucket_bytes=1 << 20))
        broadcaster.connect([url], [1], "127.0.0.1", free_port())
        try:
            with weight_update_session([url]):
                assert broadcaster.push(state, "1") == ["1"]
            engine_log_probs_match(url, model)
        finally:
            broadcaster.close()
    finally:
        deployment.stop()


def test_cuda_ipc_handles_and_memory_hand_over_on_one_gpu(tiny_checkpoint):
    needs_gpus(1)
    import asyncio

    from slime_search.engines.client import EngineClient, EngineClientConfig
    from slime_search.engines.weight_wire import tensor_bucket_payload
    from slime_search.weight_sync.tensor_handles import post_bucket
    from slime_search.weight_sync.transport_base import served_versions

    model, state = perturbed_on_gpu(tiny_checkpoint)
    deployment, url = launch_engine(tiny_checkpoint, 0, "--enable-memory-saver")
    try:

        async def hand_over():
            client = EngineClient(EngineClientConfig(url))
            try:
                await client.release_memory()
                await client.resume_memory(["weights"])
                # one flattened bucket: a single CUDA IPC handle for the whole state
                entry, load_format, _kept = tensor_bucket_payload(list(state.items()))
                assert load_format == "flattened_bucket"
                await client.begin_weight_update()
                await post_bucket(url, [entry], "2", load_format)
                await client.end_weight_update()
                await client.resume_memory(["kv_cache", "cuda_graph"])
            finally:
                await client.close()

        asyncio.run(hand_over())
        assert asyncio.run(served_versions([url])) == ["2"]
        engine_log_probs_match(url, model)
    finally:
        deployment.stop()
