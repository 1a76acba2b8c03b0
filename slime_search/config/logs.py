"""What the run logs beside its metrics, its command-line flags declared as the fields of `LogConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from slime_search.utils.flag_fields import flag
from slime_search.utils.flag_types import non_negative_int


@dataclass(frozen=True)
class LogConfig:
    log_rollout_examples: int = flag(4, "rollouts kept per step for the report", type=non_negative_int)
    use_wandb: bool = flag(False, "also log to wandb (offline without an API key)", slime=True)
    wandb_project: str = flag("slime-search", "wandb project", slime=True)
    wandb_group: str | None = flag(None, "wandb group", slime=True)
