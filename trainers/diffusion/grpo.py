"""Flow-GRPO (Liu et al. 2025) on the small flow model: RL on a text-to-image sampler.

Only what is particular to this trainer lives here: the model is warm-started (from
flow pretraining), rollouts sample and score groups of images for the data's prompts,
and the loss is the clipped objective of one trained denoising step per micro-batch
(:func:`trainers.diffusion.flow_rl.flow_grpo_step_loss`). The sampling and the loss are
shared with the other image tracks (trainers/diffusion/flow_rl.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import msgspec
import torch
from torch import Tensor

from corun import Batch, Part, RolloutContext, SetupContext, shared_count
from trainers.diffusion.base import FlowTrainer
from trainers.diffusion.flow_rl import (
    FlowGRPOSettings,
    ImageGroups,
    Sampling,
    check_data_parallel,
    flow_grpo_step_loss,
    sample_groups,
)
from trainers.diffusion.model import FlowDiT, build_model, load_model, model_from
from trainers.diffusion.settings import FlowTrainerConfig
from trainers.diffusion.shapes import ShapeBatch
from trainers.weights import (
    Replicas,
    ReplicatedRollouts,
    frozen_copy,
    gathered_state,
    kl_anchor,
    to_device,
    warm_start_runs,
)


class FlowGRPOConfig(FlowTrainerConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # Warm start: a checkpoint directory, or the .toml config of a run that corun
    # trains first when its final checkpoint is missing. Empty: a fresh model.
    init_from: str = ""
    lr: Annotated[float, msgspec.Meta(gt=0)] = 1e-4
    # [trainer.grpo]: group size, SDE noise, trained steps, clipping, KL, reward.
    grpo: FlowGRPOSettings = FlowGRPOSettings()

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.sample_steps, self.shift, self.cfg_scale)


class FlowGRPOTrainer(ReplicatedRollouts, FlowTrainer[FlowGRPOConfig]):
    Config = FlowGRPOConfig
    shards_model = True  # run.parallel = "fsdp": its sampler holds whole weights
    # Under torchrun each rank samples whole groups (its shard of the prompts), and the
    # loss is a mean over every rank's images (shared_count).
    data_parallel = True

    def prerequisites(self) -> list[str]:
        return warm_start_runs(self.config.init_from)

    def setup(self, ctx: SetupContext) -> None:
        cfg = self.config
        check_data_parallel(cfg.grpo)
        self.model = model_from(cfg.init_from) if cfg.init_from else build_model(cfg.model_config())
        self.finish_setup(ctx, cfg.lr)  # the model on the run's device
        ctx.add_optimizer(self.optimizer, grad_clip=cfg.grad_clip)
        # The model as it starts, whole (a copy where it is sharded), on the device.
        whole, self.sampler_source = self.sampler_source or self.model, None
        self.reference = kl_anchor(whole, cfg.grpo.kl_coef)
        # The sampler is the rollout engine: its own weights, replaced only by a sync.
        # Rollout workers on other threads (concurrency > 1) use replicas of it.
        self.replicas: Replicas[FlowDiT] = Replicas(
            frozen_copy(whole), sampler_replica(whole, self.device), load_weights,
            initial=self.rollout_weights(), ctx=ctx,
        )  # fmt: skip
        self.sampler = self.replicas.home

    # ---- rollout
    def rollout(self, inputs: ShapeBatch, ctx: RolloutContext) -> Batch:
        sampler, version = self.replicas.local(ctx.version)
        # The prompts condition the sampler on the device; the rewards read them on the CPU.
        groups, metrics = sample_groups(
            sampler, to_device(inputs.tokens, self.device), inputs.tokens, self.config.grpo,
            self.config.sampling, ctx.generator,
        )  # fmt: skip
        return Batch(groups, {f"rollout/{k}": v for k, v in metrics.items()}, version=version)

    # ---- train: one trained denoising step per micro-batch
    row_micro_batches = False  # each step covers all the mini-batch's images

    def micro_batches(self, batch: Batch) -> int:
        return len(batch.data.steps)

    def row_tokens(self, batch: Batch) -> list[int]:
        """An image costs its latent's positions (each row the same): the token budget
        splits a step's images into chunks of rows."""
        groups: ImageGroups = batch.data
        height, width = groups.trajectory.latents.shape[-2:]
        return [height * width] * len(groups)

    def loss(self, batch: Batch, part: Part) -> tuple[Tensor, dict[str, float]]:
        groups: ImageGroups = batch.data
        n = len(groups)
        chunk = groups.rows(part.rows(n) if part.split else part.mini_rows(n))
        self.model.train()
        loss, metrics = flow_grpo_step_loss(
            self.model, self.reference, chunk, chunk.steps[part.micro], self.config.grpo,
            over_mini_batch(part, n) if part.split else shared_count,
        )  # fmt: skip
        return loss / part.micros, metrics

    # ---- sync: the sampler takes the trained weights
    def rollout_weights(self) -> dict[str, Tensor]:
        """The trained weights; when sharded, gathered whole (every rank together)."""
        return gathered_state(self.model)


def over_mini_batch(part: Part, n: int) -> Callable[[Tensor], Tensor]:
    """What a chunk's means divide by: its mini-batch's images (under torchrun every
    rank's), so the chunks' losses and metrics are shares that add up to the whole."""
    rows = part.mini_rows(n)

    def count(local: Tensor) -> Tensor:
        return shared_count(torch.full_like(local, float(rows.stop - rows.start)))

    return count


def sampler_replica(model: FlowDiT, device: torch.device) -> Any:
    """Builds a frozen sampler of ``model``'s shape on ``device`` from published weights."""
    config = msgspec.structs.asdict(model.config)
    return lambda state, version: frozen_copy(
        load_model({"model_config": config, "model": state}, device)
    )


def load_weights(model: FlowDiT, state: dict[str, Tensor], version: int = 0) -> None:
    with torch.no_grad():
        model.load_state_dict(state)


__all__ = ["FlowGRPOConfig", "FlowGRPOTrainer"]
