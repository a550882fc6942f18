"""Settings every flow-model trainer shares: the model shape and how evaluation samples,
validated when the config is read (a shape the model cannot build is exit 2, not a
crash at set-up)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from corun.base.config import TrainerConfig
from trainers.diffusion.model import FlowModelConfig

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


class FlowTrainerConfig(TrainerConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # Model shape (for a fresh model; a warm start takes the checkpoint's).
    patch_size: Literal[2, 4, 8] = 4  # must divide the 16-pixel image
    d_model: PositiveInt = 64
    n_layers: PositiveInt = 3
    n_heads: PositiveInt = 4
    # Evaluation: Euler ODE steps on a time grid shifted by `shift` (1 = uniform),
    # classifier-free guidance scale (1 = conditional model alone, 0 = unconditional).
    sample_steps: PositiveInt = 10
    shift: PositiveFloat = 1.0
    cfg_scale: NonNegativeFloat = 1.0
    weight_decay: NonNegativeFloat = 0.0
    # Max global gradient norm; 0 turns clipping off (the norm is still reported).
    grad_clip: NonNegativeFloat = 1.0
    # Held-out prompts sampled by every evaluation, and how many go in its PNG grid
    # (<run dir>/samples/step-<N>.png; 0 writes none).
    eval_size: PositiveInt = 72
    grid_size: NonNegativeInt = 24

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads or self.d_model % 2:
            # Paths relative to this table, like msgspec's own; the loader prefixes `.trainer`.
            raise ValueError(
                f"`$.d_model` ({self.d_model}) must be even and divisible by `$.n_heads` "
                f"({self.n_heads})"
            )

    def model_config(self) -> FlowModelConfig:
        return FlowModelConfig(
            patch_size=self.patch_size, d_model=self.d_model, n_layers=self.n_layers,
            n_heads=self.n_heads,
        )  # fmt: skip
