"""Pretraining a small text-to-image flow model (FlowDiT) on the synthetic shapes data.

The diffusion counterpart of SFT, and the warm start of Flow-GRPO: "rollout" builds
the batch (rendered images, prompt tokens, and the flow-matching noise, times and
condition dropout, drawn from the rollout's generator), and the loss is the
rectified-flow MSE. Evaluation ODE-samples a fixed set of
held-out prompts from fixed noise, scores the images with the colour and position
rewards, and writes a PNG grid to ``<run dir>/samples/step-<N>.png``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import msgspec
import torch
from torch import Tensor

from corun import Batch, Part, RolloutContext, SetupContext, shared_count
from trainers.diffusion.base import FlowTrainer
from trainers.diffusion.model import build_model, load_model, model_from
from trainers.diffusion.sampling import flow_matching_loss
from trainers.diffusion.settings import FlowTrainerConfig, NonNegativeFloat
from trainers.diffusion.shapes import NULL, ShapeBatch
from trainers.weights import to_device

__all__ = ["FlowPretrainConfig", "FlowPretrainTrainer", "load_model", "model_from"]


class FlowPretrainConfig(FlowTrainerConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[trainer]`` of a flow pretraining run: model shape, optimizer, guidance dropout."""

    lr: Annotated[float, msgspec.Meta(gt=0)] = 1e-3
    # Share of training prompts replaced by the empty (NULL) prompt, which trains the
    # unconditional model that classifier-free guidance needs.
    cond_dropout: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.1
    # Scale of the data's random offsets in position and colour (shapes.render): 1 is
    # tidy data; larger is sloppy data whose model follows prompts only roughly.
    jitter: NonNegativeFloat = 1.0


@dataclass(frozen=True)
class FlowBatch:
    """One flow-matching batch: x_t is built from these in the train step."""

    images: Tensor  # (N, 3, 16, 16) data x0
    tokens: Tensor  # (N, 3), rows dropped to NULL for guidance
    t: Tensor  # (N,) times in [0, 1]
    noise: Tensor  # (N, 3, 16, 16) ε

    def __len__(self) -> int:
        return self.t.shape[0]

    def rows(self, rows: slice) -> FlowBatch:
        return FlowBatch(self.images[rows], self.tokens[rows], self.t[rows], self.noise[rows])


def flow_batch(data: ShapeBatch, generator: torch.Generator, cond_dropout: float) -> FlowBatch:
    """Draw times, noise and condition dropout for ``data`` from ``generator``: on the
    CPU by design (the data's and the generator's device), so a seed gives the same
    batch on every device."""
    n = len(data)
    t = torch.rand(n, generator=generator)
    noise = torch.randn(data.images.shape, generator=generator)
    dropped = torch.rand(n, generator=generator) < cond_dropout
    tokens = torch.where(dropped.unsqueeze(1), NULL, data.tokens)
    return FlowBatch(data.images, tokens, t, noise)


class FlowPretrainTrainer(FlowTrainer[FlowPretrainConfig]):
    Config = FlowPretrainConfig
    data_parallel = True  # the loss is a mean over every rank's pixels (shared_count)
    shards_model = True  # run.parallel = "fsdp"

    def setup(self, ctx: SetupContext) -> None:
        # The runtime has seeded the global RNGs with run.seed: the model init draws from them.
        self.jitter = self.config.jitter
        self.model = build_model(self.config.model_config())
        self.finish_setup(ctx, self.config.lr)
        ctx.add_optimizer(self.optimizer, grad_clip=self.config.grad_clip)

    def rollout(self, inputs: ShapeBatch, ctx: RolloutContext) -> Batch:
        """The build phase: draw the flow-matching randomness; nothing is generated."""
        return Batch(data=flow_batch(inputs, ctx.generator, self.config.cond_dropout))

    def prepare(self, batch: Batch) -> FlowBatch:
        """The batch (built on the CPU) to the model's device, once."""
        return to_device(batch.data, self.device)

    def loss(self, batch: Batch, part: Part) -> tuple[Tensor, dict[str, float]]:
        data: FlowBatch = batch.data
        data = data.rows(part.mini_rows(len(data)))
        self.model.train()
        loss = flow_matching_loss(
            self.model, data.images, data.tokens, data.t, data.noise, shared_count
        )
        return loss, {}
