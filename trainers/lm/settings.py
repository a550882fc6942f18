"""Settings every TinyLM trainer shares: the task and the model shape, validated
when the config is read (a shape the model cannot build is exit 2, not a crash at
set-up)."""

from __future__ import annotations

from typing import Annotated, Literal, get_args

import msgspec

from corun.base.config import TrainerConfig
from trainers.lm.tasks import TASKS

TaskName = Literal["sort", "addition", "reverse"]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
assert set(get_args(TaskName)) == TASKS.keys(), "TaskName must list exactly the tasks"


class LMTrainerConfig(TrainerConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    task: TaskName = "sort"
    d_model: PositiveInt = 128  # model shape (RL: for a fresh model only)
    n_layers: PositiveInt = 2
    n_heads: PositiveInt = 4

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            # Paths relative to this table, like msgspec's own; the loader prefixes `.trainer`.
            raise ValueError(
                f"`$.d_model` ({self.d_model}) must be divisible by `$.n_heads` ({self.n_heads})"
            )
