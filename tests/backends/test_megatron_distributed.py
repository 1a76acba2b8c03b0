"""Process-group set-up of a Megatron rank: --seed seeds every RNG the actor draws from."""

import json

import pytest
import torch.multiprocessing as mp

from slime_search.utils.net import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _seed_worker(rank: int, port: int, seed: int, out_path: str) -> None:
    import random

    import numpy
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from slime_search.backends.megatron.distributed import init_megatron, shutdown

    init_megatron(rank, 1, tp_size=1, master_port=port, seed=seed)
    draws = {"random": random.random(), "numpy": float(numpy.random.rand()), "torch": torch.rand(3).tolist()}
    with get_cuda_rng_tracker().fork():  # the model-parallel RNG (dropout and initialisation inside TP regions)
        draws["model_parallel"] = torch.rand(3).tolist()
    shutdown()
    with open(out_path, "w") as handle:
        json.dump(draws, handle)


def test_init_megatron_seeds_python_numpy_torch_and_the_model_parallel_rng(tmp_path):
    import random

    import numpy
    import torch

    out = tmp_path / "draws.json"
    mp.spawn(_seed_worker, args=(free_port(), 7, str(out)), nprocs=1, join=True)
    draws = json.loads(out.read_text())
    assert draws["random"] == random.Random(7).random()
    assert draws["numpy"] == numpy.random.RandomState(7).rand()
    assert draws["torch"] == torch.rand(3, generator=torch.Generator().manual_seed(7)).tolist()
    # Megatron's model-parallel seed is seed + 2718 + the TP rank (0 here)
    assert draws["model_parallel"] == torch.rand(3, generator=torch.Generator().manual_seed(7 + 2718)).tolist()
