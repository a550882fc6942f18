"""Settings every TinyLM trainer shares: the task and the model shape, validated
when the config is read (a shape the model cannot build is exit 2, not a crash at
set-up)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar, cast, get_args

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
    # Memory: the most logits (positions x vocabulary entries) one log-prob pass holds
    # at once; longer batches are computed in chunks of positions, and backward
    # recomputes each chunk. 0: the whole batch at once.
    logits_chunk: Annotated[int, msgspec.Meta(ge=0)] = 1 << 24
    # Memory: recompute each block's activations in the backward pass instead of keeping
    # them, for a longer step (a TinyLM policy; hf kinds: their own key of this name).
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            # Paths relative to this table, like msgspec's own; the loader prefixes `.trainer`.
            raise ValueError(
                f"`$.d_model` ({self.d_model}) must be divisible by `$.n_heads` ({self.n_heads})"
            )


S = TypeVar("S", bound=LMTrainerConfig)


def with_settings(
    name: str, base: type[S], settings: type[msgspec.Struct], check: Callable[[Any], None]
) -> type[S]:
    """The config class ``name``: ``base``'s fields, then ``settings``' (keys of the same
    table, as a subclass would add them: one that ``base`` has takes its place), then
    ``check(config)`` after ``base``'s own validation.

    Built rather than inherited because a msgspec Struct takes fields from one base
    only, and a source of batches (an hf: policy, agent episodes) adds the same
    settings to GRPO's and to PPO's.
    """

    def post_init(config: Any) -> None:
        base.__post_init__(config)
        check(config)

    fields = [_field(f) for f in msgspec.structs.fields(settings)]
    built = msgspec.defstruct(
        name, fields, bases=(base,), module=settings.__module__,
        namespace={"__post_init__": post_init}, frozen=True, forbid_unknown_fields=True,
        kw_only=True,
    )  # fmt: skip
    return cast(type[S], built)


def _field(field: msgspec.structs.FieldInfo) -> tuple[str, Any] | tuple[str, Any, Any]:
    if field.default_factory is not msgspec.NODEFAULT:
        return field.name, field.type, msgspec.field(default_factory=field.default_factory)
    if field.default is not msgspec.NODEFAULT:
        return field.name, field.type, field.default
    return field.name, field.type
