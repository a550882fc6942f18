"""Flow-GRPO (Liu et al. 2025) on the small flow model: RL on a text-to-image sampler.

Only what is particular to this trainer lives here: the model is warm-started (from
flow pretraining), rollouts sample and score groups of images for the data's prompts,
and the train step accumulates :func:`trainers.diffusion.flow_rl.flow_grpo_backward`
over ``loop.accumulate`` rollouts before one optimizer update. The sampling and the
loss are shared with the other image tracks (trainers/diffusion/flow_rl.py).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import torch
from torch import Tensor

from corun.pipeline import is_config
from corun.trainer import Batch, SetupContext
from trainers.common import apply_update, frozen_copy
from trainers.diffusion.flow_rl import (
    FlowGRPOSettings,
    ImageGroups,
    Sampling,
    flow_grpo_backward,
    sample_groups,
)
from trainers.diffusion.model import FlowDiT, build_model, load_model, model_from
from trainers.diffusion.settings import FlowTrainerConfig, NonNegativeFloat
from trainers.diffusion.shapes import ShapeBatch, stable_seed
from trainers.diffusion.trainer import FlowTrainer
from trainers.replicas import Replicas


class FlowGRPOConfig(FlowTrainerConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # Warm start: a checkpoint directory, or the .toml config of a run that corun
    # trains first when its final checkpoint is missing. Empty: a fresh model.
    init_from: str = ""
    lr: Annotated[float, msgspec.Meta(gt=0)] = 1e-4
    weight_decay: NonNegativeFloat = 0.0
    grad_clip: NonNegativeFloat = 1.0
    # [trainer.grpo]: group size, SDE noise, trained steps, clipping, KL, reward.
    grpo: FlowGRPOSettings = FlowGRPOSettings()

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.sample_steps, self.shift, self.cfg_scale)


class FlowGRPOTrainer(FlowTrainer[FlowGRPOConfig]):
    Config = FlowGRPOConfig
    accumulates = True

    def prerequisites(self) -> list[str]:
        return [self.config.init_from] if is_config(self.config.init_from) else []

    def setup(self, ctx: SetupContext) -> None:
        cfg = self.config
        self.model = model_from(cfg.init_from) if cfg.init_from else build_model(cfg.model_config())
        self.reference = frozen_copy(self.model) if cfg.grpo.kl_coef > 0 else None
        self.finish_setup(ctx, cfg.lr, cfg.weight_decay)
        # The sampler is the rollout engine: its own weights, replaced only by a sync.
        # Rollout workers on other threads (concurrency > 1) use replicas of it.
        self.replicas: Replicas[FlowDiT] = Replicas(
            frozen_copy(self.model), _replica_of(self.model), _load_weights,
            shared=self.run_config.loop.concurrency > 1, initial=self.model.state_dict(),
        )  # fmt: skip
        self.sampler = self.replicas.home

    @property
    def sampler_version(self) -> int:
        return self.replicas.version

    # ---- rollout
    def rollout(self, inputs: ShapeBatch, step: int) -> Batch:
        # Every draw of this batch comes from a generator of (seed, step): the same
        # batch on any thread, in any order, and again after a resume.
        seed = stable_seed("flow-grpo", self.run_config.run.seed, step)
        sampler, version = self.replicas.local()
        groups, metrics = sample_groups(
            sampler, inputs.tokens, inputs.tokens, self.config.grpo, self.config.sampling,
            torch.Generator().manual_seed(seed),
        )  # fmt: skip
        return Batch(groups, {f"rollout/{k}": v for k, v in metrics.items()}, version=version)

    # ---- train
    def train_step(self, batch: Batch) -> dict[str, float]:
        """The clipped loss over the batch's denoising steps; the update is applied at
        the end of the window (every batch without ``loop.accumulate``)."""
        groups: ImageGroups = batch.data
        self.model.train()
        if batch.window_pos == 0:
            self.optimizer.zero_grad(set_to_none=True)
        metrics = flow_grpo_backward(
            self.model, self.reference, groups, self.config.grpo, 1.0 / batch.window_size
        )
        if batch.ends_window:
            params = self.model.parameters()
            metrics["grad_norm"] = apply_update(params, self.optimizer, self.config.grad_clip)
        return {f"train/{k}": v for k, v in metrics.items()}

    # ---- sync, eval, state
    def sync_weights(self, version: int) -> None:
        self.replicas.sync(self.model.state_dict(), version)


def _replica_of(model: FlowDiT) -> Any:
    config = msgspec.structs.asdict(model.config)
    return lambda state, version: frozen_copy(load_model({"model_config": config, "model": state}))


def _load_weights(model: FlowDiT, state: dict[str, Tensor], version: int = 0) -> None:
    with torch.no_grad():
        model.load_state_dict(state)


__all__ = ["FlowGRPOConfig", "FlowGRPOTrainer"]
