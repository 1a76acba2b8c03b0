"""The rollout side's configuration: the prompt data, one rollout's shape, the engines' sampling and the plugins,
their command-line flags declared as the fields (slime's names). The engines, the eval sets and the log folder are
set by `slime_search.run.config` from other flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slime_search.config.engines import EngineConfig
from slime_search.evaluation.subsets import EvalSubset
from slime_search.utils.flag_fields import REQUIRED, flag
from slime_search.utils.flag_types import non_negative_int, positive_float, positive_int, probability


@dataclass(frozen=True)
class DataConfig:
    path: str = flag(
        REQUIRED, "training prompts: parquet or jsonl, Search-R1's schema", name="--prompt-data", slime=True
    )
    input_key: str = flag("prompt", "column of a prompt row that holds the prompt", slime=True)
    label_key: str = flag("reward_model", "column of a prompt row that holds the label", slime=True)
    metadata_key: str = "extra_info"
    shuffle: bool = flag(False, "shuffle the prompts every epoch", name="--rollout-shuffle", slime=True)
    seed: int = flag(
        42,
        "seed of the prompt order and of each trajectory's sampling (on engines that seed it: the CPU engine, SGLang "
        "with --enable-deterministic-inference)",
        name="--rollout-seed",
        type=non_negative_int,
        slime=True,
    )
    # read by the generate plugin from its `args` (slime's contract), not by the data source
    apply_chat_template: bool = flag(False, "render the prompt with the tokenizer's chat template", slime=True)


@dataclass(frozen=True)
class RolloutConfig:
    batch_size: int = flag(REQUIRED, "prompts per rollout", name="--rollout-batch-size", type=positive_int, slime=True)
    n_samples_per_prompt: int = flag(8, "samples per prompt: one GRPO group", type=positive_int, slime=True)
    max_concurrency: int = flag(
        256, "trajectories generated at once, at most", name="--rollout-concurrency", type=positive_int
    )
    filter_zero_std: bool = flag(
        False,
        "drop groups whose rewards are all equal (no GRPO signal) and generate more in their place",
        name="--over-sampling-filter-zero-std",
        slime=True,
    )
    max_oversample_rounds: int = 4
    reward_key: str = flag("score", "key of the reward plugin's dict that is the reward", slime=True)
    normalize_advantages_std: bool = True  # --advantage-estimator grpo (dr_grpo: False)


@dataclass(frozen=True)
class SamplingConfig:
    """How the engines sample the training rollouts (evaluation is greedy)."""

    max_new_tokens: int = flag(
        512, "max new tokens per turn", name="--rollout-max-response-len", type=positive_int, slime=True
    )
    temperature: float = flag(
        1.0,
        "sampling temperature of the rollouts, > 0: the trainer divides its logits by it to recompute the log-probs "
        "the engine sampled with (greedy decoding has no such distribution; evaluation is greedy anyway)",
        name="--rollout-temperature",
        type=positive_float,
        slime=True,
    )
    top_p: float = flag(
        1.0,
        "nucleus sampling of the rollouts, in (0, 1]; below 1 the engine samples from a truncated distribution while "
        "the trainer's log-probs are over the full vocabulary, so --use-tis / --use-mis are refused with it",
        name="--rollout-top-p",
        type=probability,
        slime=True,
    )

    def params(self, seed: int) -> dict[str, Any]:
        """A training rollout's sampling; `sampling_seed` is the base of each trajectory's own."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_new_tokens": self.max_new_tokens,
            "sampling_seed": seed,
        }

    def greedy_params(self) -> dict[str, Any]:
        """An evaluation's sampling."""
        return {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": self.max_new_tokens}


@dataclass(frozen=True)
class RolloutManagerConfig:
    engines: EngineConfig
    data: DataConfig  # the training prompts
    rollout: RolloutConfig
    generate_path: str = flag(
        "slime_search.search_r1.generate.generate",
        "the generate plugin, by dotted path: async generate(args, sample, sampling_params) -> Sample",
        name="--custom-generate-function-path",
        slime=True,
    )
    reward_path: str = flag(
        "slime_search.search_r1.reward.reward_func",
        "the reward plugin, by dotted path: async reward_func(args, sample) -> float | dict",
        name="--custom-rm-path",
        slime=True,
    )
    sampling_params: dict[str, Any] = field(default_factory=dict)  # training rollouts
    eval_sampling_params: dict[str, Any] = field(default_factory=dict)  # evaluation (greedy)
    eval_sets: tuple[tuple[str, str], ...] = ()  # (name, path) of every --eval-prompt-data set
    eval_subset: EvalSubset = field(default_factory=EvalSubset)  # which questions of each set are graded
    log_dir: str = "."  # where the engines' logs go
    served_adapter: str | None = None  # --lora-sync-from-tensor: the adapter every /generate names (SGLang's lora_path)
