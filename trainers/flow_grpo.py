"""Flow-GRPO (Liu et al. 2025) on the small flow model: RL on a text-to-image sampler.

Only what is particular to Flow-GRPO lives here. A rollout samples
``samples_per_prompt`` images per prompt with the SDE sampler, which makes every
denoising step a Gaussian policy action with a log-prob; the images are scored in code
(colour and position, :func:`trainers.diffusion.shapes.score`) and each image's
advantage is its reward against its prompt's group (:func:`trainers.pg.group_advantages`,
shared with GRPO). The train step applies the clipped ratio loss
(:func:`trainers.pg.clipped_surrogate`) to a subset of the sampled denoising steps,
with an optional KL to the frozen starting model; with ``loop.accumulate`` several
rollouts accumulate into one optimizer update.

As in the reference implementation, the ratio uses each transition's log-density per
pixel (the sum over pixels divided by their number): a whole-image density ratio moves
by orders of magnitude for a tiny weight change, and clipping would then bite always.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
import torch
from torch import Tensor

from corun.compute import cancel_point
from corun.pipeline import is_config
from corun.trainer import Batch, SetupContext
from trainers.common import apply_update, frozen_copy
from trainers.diffusion.model import (
    FlowDiT,
    build_model,
    load_model,
    model_from,
)
from trainers.diffusion.sampling import Trajectory, sample_sde, step_log_prob
from trainers.diffusion.settings import FlowTrainerConfig, NonNegativeFloat
from trainers.diffusion.shapes import ShapeBatch, score, stable_seed
from trainers.diffusion.trainer import FlowTrainer
from trainers.pg import AdvantageScope, clipped_surrogate, group_advantages, zero_std_groups
from trainers.replicas import Replicas

UnitFloat = Annotated[float, msgspec.Meta(gt=0, le=1)]


class FlowGRPOConfig(FlowTrainerConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # Warm start: a checkpoint directory, or the .toml config of a run that corun
    # trains first when its final checkpoint is missing. Empty: a fresh model.
    init_from: str = ""
    lr: Annotated[float, msgspec.Meta(gt=0)] = 1e-4
    weight_decay: NonNegativeFloat = 0.0
    grad_clip: NonNegativeFloat = 1.0
    samples_per_prompt: Annotated[int, msgspec.Meta(ge=2)] = 8
    # SDE noise level a (σ_t = a·sqrt(t / (1 − t))): how far rollouts explore.
    noise_level: Annotated[float, msgspec.Meta(gt=0)] = 0.7
    # Share of the sample_steps denoising steps trained per rollout: the first ones
    # ("first": the early, noisy steps decide where the shape goes and what colour it
    # is; here they learn 2-3x faster than a random subset) or a random subset per batch.
    timestep_fraction: UnitFloat = 1.0
    timestep_choice: Literal["first", "random"] = "first"
    clip_range: Annotated[float, msgspec.Meta(gt=0)] = 1e-3
    adv_clip_max: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    adv_scope: AdvantageScope = "group"
    adv_std_norm: bool = True
    # KL to the frozen starting model (Gaussian steps of equal std: a mean distance).
    kl_coef: NonNegativeFloat = 0.0
    # The reward: color_weight · colour match + (1 − color_weight) · position match.
    color_weight: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.5

    @property
    def trained_steps(self) -> int:
        return max(1, math.ceil(self.sample_steps * self.timestep_fraction))


@dataclass
class FlowGRPOBatch:
    trajectory: Trajectory
    advantages: Tensor  # (N,)
    steps: list[int]  # the denoising steps this batch trains on


class FlowGRPOTrainer(FlowTrainer[FlowGRPOConfig]):
    Config = FlowGRPOConfig
    accumulates = True

    def prerequisites(self) -> list[str]:
        return [self.config.init_from] if is_config(self.config.init_from) else []

    def setup(self, ctx: SetupContext) -> None:
        cfg = self.config
        self.model = model_from(cfg.init_from) if cfg.init_from else build_model(cfg.model_config())
        self.reference = frozen_copy(self.model) if cfg.kl_coef > 0 else None
        self.finish_setup(ctx, cfg.lr, cfg.weight_decay)
        # The sampler is the rollout engine: its own weights, replaced only by a sync.
        # Rollout workers on other threads (concurrency > 1) use replicas of it.
        self.sampler = frozen_copy(self.model)
        self.sampler_version = 0
        self._train_thread = threading.get_ident()
        self.replicas: Replicas[FlowDiT] = Replicas(_replica_of(self.model), _load_weights)
        self.replicas.publish(self.model.state_dict(), 0)

    # ---- rollout
    def rollout(self, inputs: ShapeBatch, step: int) -> Batch:
        cfg, n = self.config, self.config.samples_per_prompt
        # Every draw of this batch comes from a generator of (seed, step): the same
        # batch on any thread, in any order, and again after a resume.
        generator = torch.Generator().manual_seed(
            stable_seed("flow-grpo", self.run_config.run.seed, step)
        )
        sampler, version = self._sampler()
        tokens = inputs.tokens.repeat_interleave(n, dim=0)
        trajectory = sample_sde(
            sampler, tokens, num_steps=cfg.sample_steps, noise_level=cfg.noise_level,
            shift=cfg.shift, cfg_scale=cfg.cfg_scale, generator=generator,
        )  # fmt: skip
        rewards = score(trajectory.images, tokens, cfg.color_weight)
        advantages = group_advantages(rewards.total, n, cfg.adv_scope, cfg.adv_std_norm)
        if cfg.timestep_choice == "first":
            steps = list(range(cfg.trained_steps))
        else:
            steps = sorted(
                torch.randperm(cfg.sample_steps, generator=generator)[: cfg.trained_steps].tolist()
            )
        metrics = {
            "rollout/reward_mean": float(rewards.total.mean()),
            "rollout/reward_std": float(rewards.total.std()),
            "rollout/color_reward": float(rewards.color.mean()),
            "rollout/position_reward": float(rewards.position.mean()),
            "rollout/zero_std_group_ratio": float(zero_std_groups(rewards.total, n).float().mean()),
        }
        data = FlowGRPOBatch(
            trajectory, advantages.clamp(-cfg.adv_clip_max, cfg.adv_clip_max), steps
        )
        return Batch(data, metrics=metrics, version=version)

    def _sampler(self) -> tuple[FlowDiT, int]:
        if threading.get_ident() == self._train_thread:
            return self.sampler, self.sampler_version
        return self.replicas.local()

    # ---- train
    def train_step(self, batch: Batch) -> dict[str, float]:
        """The clipped loss over the batch's denoising steps, one backward per step; the
        update is applied at the end of the window (every batch without accumulate)."""
        cfg, data = self.config, batch.data
        trajectory, advantages = data.trajectory, data.advantages
        pixels = trajectory.latents[0, 0].numel()
        self.model.train()
        if batch.window_pos == 0:
            self.optimizer.zero_grad(set_to_none=True)
        per_step: dict[str, list[float]] = {"train/loss": [], "train/clip_ratio": [],
                                            "train/kl": [], "train/approx_kl": []}  # fmt: skip
        for i, step in enumerate(data.steps):
            if i:
                cancel_point()
            density = step_log_prob(self.model, trajectory, step)
            logp, old_logp = density.log_prob / pixels, trajectory.log_probs[:, step] / pixels
            per_image, clipped = clipped_surrogate(
                logp, old_logp, advantages, cfg.clip_range, cfg.clip_range
            )
            loss = per_image.mean()
            kl = torch.zeros(())
            if self.reference is not None:
                with torch.no_grad():
                    anchor = step_log_prob(self.reference, trajectory, step).mean
                # Two Gaussians of equal std: KL = |mean − anchor|² / (2·std²), per pixel.
                distance = (density.mean - anchor).square().flatten(1).mean(dim=1)
                kl = (distance / (2 * density.std.square())).mean()
                loss = loss + cfg.kl_coef * kl
            # Each step's share of the window's update: a mean over steps and batches.
            (loss / (len(data.steps) * batch.window_size)).backward()
            per_step["train/loss"].append(float(loss.detach()))
            per_step["train/clip_ratio"].append(float(clipped.float().mean()))
            per_step["train/kl"].append(float(kl.detach()))
            per_step["train/approx_kl"].append(float((old_logp - logp.detach()).mean()))
        totals = {key: sum(values) / len(values) for key, values in per_step.items()}
        if batch.ends_window:
            params = self.model.parameters()
            totals["train/grad_norm"] = apply_update(params, self.optimizer, cfg.grad_clip)
        return totals

    # ---- sync, eval, state
    def sync_weights(self, version: int) -> None:
        _load_weights(self.sampler, self.model.state_dict())
        self.sampler_version = version
        if self.run_config.loop.concurrency > 1:
            self.replicas.publish(self.model.state_dict(), version)


def _replica_of(model: FlowDiT) -> Any:
    config = msgspec.structs.asdict(model.config)
    return lambda state, version: frozen_copy(load_model({"model_config": config, "model": state}))


def _load_weights(model: FlowDiT, state: dict[str, Tensor], version: int = 0) -> None:
    with torch.no_grad():
        model.load_state_dict(state)


__all__ = ["FlowGRPOConfig", "FlowGRPOTrainer"]
