"""The engines' configuration, its command-line flags declared as its fields (slime's names where slime has the
flag). The model, the seed and, colocated, the GPUs and the memory saver are
derived from other flags by `slime_search.run.config`."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from slime_search.utils.flag_fields import flag
from slime_search.utils.flag_types import non_negative_int, port, positive_float, positive_int, probability


def shell_words(text: str) -> tuple[str, ...]:
    return tuple(shlex.split(text))


@dataclass(frozen=True)
class EngineConfig:
    model_path: str  # HF folder the engines load (weights, tokenizer): --hf-checkpoint
    engine_url: str | None = flag(None, "use these running engines (URL[,URL...]) instead of starting any")
    num_gpus: int = flag(
        0,
        "GPUs for SGLang engines (0: the CPU engine)",
        name="--rollout-num-gpus",
        type=non_negative_int,
        slime=True,
    )
    gpus_per_engine: int = flag(
        1,
        "GPUs of one SGLang engine (its tensor-parallel size); must divide --rollout-num-gpus",
        name="--rollout-num-gpus-per-engine",
        type=positive_int,
        slime=True,
    )
    mem_fraction_static: float = flag(
        0.8,
        "share of each engine GPU's memory SGLang takes for weights and KV cache",
        name="--sglang-mem-fraction-static",
        type=probability,
        slime=True,
    )
    router_port: int = flag(0, "port of the SGLang router (0: a free one)", name="--sglang-router-port", type=port)
    memory_saver: bool = False  # colocated: SGLang's memory saver, so the engines can hand memory to the trainer
    lora_args: tuple[str, ...] = ()  # SGLang's LoRA serving flags, under --lora-sync-from-tensor (run_config)
    cpu_engines: int = flag(1, "CPU engine servers on a machine without GPUs", type=positive_int)
    cpu_max_batch_size: int = flag(
        32, "CPU engine: sequences decoded together", name="--engine-max-batch-size", type=positive_int
    )
    cpu_engine_args: tuple[str, ...] = flag(
        (),
        "more arguments for every CPU engine server this run starts, as one string: its injected faults "
        "(--decode-delay-ms, --freeze-weights-after) for measuring the health guard; write it "
        "--cpu-engine-args='--decode-delay-ms 20' (with '=': the value starts with --)",
        type=shell_words,
    )
    seed: int = 1234
    health_timeout_s: float = flag(
        60.0,
        "seconds an engine has to generate one token in the check after each rollout; one that fails it (or has "
        "exited) is started again and takes the next weight push",
        name="--engine-health-timeout",
        type=positive_float,
    )

    def __post_init__(self) -> None:
        if self.num_gpus < 0 or self.gpus_per_engine <= 0 or self.num_gpus % self.gpus_per_engine:
            raise ValueError(
                f"--rollout-num-gpus {self.num_gpus} is not a multiple of --rollout-num-gpus-per-engine "
                f"{self.gpus_per_engine}"
            )
        if self.cpu_engines < 1:
            raise ValueError(f"--cpu-engines must be >= 1, got {self.cpu_engines}")

    @property
    def ranks_per_engine(self) -> int:
        """Process-group ranks (GPUs) of one engine; a CPU engine (or a given one) is one rank."""
        return self.gpus_per_engine if self.num_gpus else 1
