"""Prompt enhancer RL (registered as ``pe``): a small LM rewrites user prompts into
the flow model's condition tokens, and both are trained on the image reward (two
tracks, two optimizers).

A rollout samples ``rewrites_per_prompt`` rewrites of each user prompt (the text
group), then ``grpo.samples_per_prompt`` SDE images of each rewrite (the image
group), scored against what the user asked for. A rewrite's reward is the mean
reward of its images, taken per token by default (the colour token is credited
with the colour reward, the place token with the position reward); its advantage is
GRPO's, against the other rewrites of the same prompt. The text track's loss is a
clipped policy gradient on the rewrite tokens; the image track's is Flow-GRPO's, one
trained denoising step per micro-batch, unless ``freeze_diffusion``. A sync publishes
both sides together, so a rollout never pairs a rewriter of one version with a
sampler of another.

Data-parallel (torchrun): each rank rewrites its shard of the users (whole text
groups, and each rewrite's whole image group), both losses are means over every
rank's tokens and images (``corun.shared_count``), and like Flow-GRPO it refuses
batch-scoped advantages and random trained steps (each rank would use its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec
import torch
from torch import Tensor

from corun import Batch, Part, RolloutContext, SetupContext, shared_count
from trainers.diffusion.flow_rl import (
    FlowGRPOSettings,
    ImageGroups,
    Sampling,
    check_data_parallel,
    flow_grpo_step_loss,
    sample_groups,
)
from trainers.diffusion.grpo import load_weights, sampler_replica
from trainers.diffusion.model import FlowDiT
from trainers.lm.engine import LocalEngine, Rollouts
from trainers.pe.base import PEBase, PEBaseConfig, PositiveFloat
from trainers.pe.prompts import REWRITE_LEN, UserBatch, flow_tokens
from trainers.pe.rewriter import load_rewriter, rewrite_logprobs
from trainers.pg import aggregate, clipped_surrogate, group_advantages, zero_std_groups
from trainers.weights import (
    Replicas,
    ReplicatedRollouts,
    frozen_copy,
    gathered_state,
    kl_anchor,
    to_device,
)

NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]


class PromptEnhancerConfig(PEBaseConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The image track's Flow-GRPO settings, the text track's RL settings, and the
    switch that freezes the image track."""

    lr: PositiveFloat = 1e-4  # the flow model's
    grpo: FlowGRPOSettings = FlowGRPOSettings()  # [trainer.grpo]: the image track
    freeze_diffusion: bool = False
    rewrites_per_prompt: Annotated[int, msgspec.Meta(ge=2)] = 4
    temperature: PositiveFloat = 1.0
    text_clip: NonNegativeFloat = 0.2  # PPO-style ratio clip of the text track
    # Which reward each rewrite token is credited with (see _token_rewards).
    text_credit: Literal["factored", "total"] = "factored"


@dataclass
class PEBatch:
    rewrites: Rollouts  # rewrites_per_prompt rows per user prompt
    advantages: Tensor  # (N, 3) one per rewrite token
    images: ImageGroups  # samples_per_prompt images per rewrite


Pair = tuple[LocalEngine, FlowDiT]  # a rollout thread's rewriter and sampler


class PromptEnhancerTrainer(ReplicatedRollouts, PEBase[PromptEnhancerConfig]):
    Config = PromptEnhancerConfig
    # Under torchrun each rank rewrites its shard of the users (whole text groups, each
    # rewrite's whole image group), and both losses are means over every rank's
    # tokens and images (shared_count).
    data_parallel = True

    def setup(self, ctx: SetupContext) -> None:
        cfg = self.config
        check_data_parallel(cfg.grpo)
        super().setup(ctx)  # the flow model, the text policy and its optimizer, eval
        if not cfg.freeze_diffusion:
            ctx.add_optimizer(self.optimizer, grad_clip=cfg.grad_clip, name="image")
        # Whole copies (of the models as they start) where they are sharded.
        text, self.engine_source = self.engine_source or self.policy, None
        image, self.sampler_source = self.sampler_source or self.model, None
        self.reference = kl_anchor(image, cfg.grpo.kl_coef)
        self.sampling = Sampling(cfg.sample_steps, cfg.shift, cfg.cfg_scale)
        # One snapshot of both sides per sync: a worker never sees them torn apart.
        self.replicas: Replicas[Pair] = Replicas(
            (LocalEngine(text), frozen_copy(image)), self._pair_of, _load_pair,
            initial=self.rollout_weights(), ctx=ctx,
        )  # fmt: skip
        self.engine, self.sampler = self.replicas.home

    @property
    def pairs(self) -> Replicas[Pair]:
        """The rollout copies (``replicas``): a rewriter engine and a sampler each."""
        return self.replicas

    def image_lr(self) -> float:
        return self.config.lr

    # ---- rollout
    def rollout(self, inputs: UserBatch, ctx: RolloutContext) -> Batch:
        cfg, k = self.config, self.config.rewrites_per_prompt
        (engine, sampler), version = self.replicas.local(ctx.version)
        # The engine samples on its device (the user prompts go there once), and so
        # does the sampler, conditioned on the rewrites; the rewards are scored on the
        # CPU against what the users asked for.
        rewrites = engine.generate(
            inputs.prompt_ids, k, REWRITE_LEN, cfg.temperature, generator=ctx.generator
        )
        conditions = flow_tokens(rewrites.response_ids)
        targets = inputs.targets.repeat_interleave(k, dim=0)
        images, image_metrics = sample_groups(
            sampler, conditions, targets, cfg.grpo, self.sampling, ctx.generator
        )
        # A rewrite earns the mean rewards of the images drawn from it: (N, 3) for
        # its colour, shape and place tokens (see _token_rewards).
        per_token = self._token_rewards(images).view(-1, cfg.grpo.samples_per_prompt, 3).mean(1)
        rewards = images.rewards.view(-1, cfg.grpo.samples_per_prompt).mean(dim=1)
        advantages = torch.stack([
            group_advantages(column, k, cfg.grpo.adv_scope, cfg.grpo.adv_std_norm)
            for column in per_token.unbind(dim=1)
        ], dim=1)  # fmt: skip
        exact = (conditions == to_device(targets, self.device)).all(dim=1)
        metrics = {
            "rollout/text/reward_mean": float(rewards.mean()),
            "rollout/text/reward_std": float(rewards.std()),
            "rollout/text/zero_std_group_ratio": float(zero_std_groups(rewards, k).float().mean()),
            "rollout/text/rewrite_exact": float(exact.float().mean()),
            **{f"rollout/image/{key}": value for key, value in image_metrics.items()},
        }
        # The advantages (from the CPU's rewards) join the rollouts on the device.
        batch = PEBatch(rewrites, to_device(advantages, self.device), images)
        return Batch(batch, metrics, version=version)

    def _token_rewards(self, images: ImageGroups) -> Tensor:
        """Per image, the reward credited to each rewrite token: "factored" gives the
        colour token the colour reward and the place token the position reward (the
        shape token, unrewarded by itself, the total), so a token's advantage is not
        noise from the others' luck; "total" gives every token the total."""
        if self.config.text_credit == "total" or images.scores is None:
            return images.rewards[:, None].expand(-1, 3)
        scores = images.scores
        return torch.stack([scores.color, scores.total, scores.position], dim=1)

    # ---- train: the text loss with the first micro-batch; one image step per micro-batch
    def micro_batches(self, batch: Batch) -> int:
        return 1 if self.config.freeze_diffusion else len(batch.data.images.steps)

    def loss(self, batch: Batch, part: Part) -> tuple[Tensor, dict[str, float]]:
        data: PEBatch = batch.data
        loss, metrics = torch.zeros((), device=self.device), dict[str, float]()
        if part.micro == 0:
            text_loss, text_metrics = self._text_loss(data, part.mini_rows(len(data.advantages)))
            loss = loss + text_loss
            metrics |= {f"text/{key}": value for key, value in text_metrics.items()}
        if not self.config.freeze_diffusion:
            images = data.images.rows(part.mini_rows(len(data.images)))
            self.model.train()
            step = images.steps[part.micro]
            step_loss, image_metrics = flow_grpo_step_loss(
                self.model, self.reference, images, step, self.config.grpo, shared_count
            )
            loss = loss + step_loss / part.micros
            image_metrics["loss"] = float(step_loss.detach())
            metrics |= {f"image/{key}": value for key, value in image_metrics.items()}
        return loss, metrics

    def _text_loss(self, data: PEBatch, rows: slice) -> tuple[Tensor, dict[str, float]]:
        """GRPO's clipped surrogate on the rewrite tokens."""
        cfg, rewrites = self.config, data.rewrites.select(rows)
        self.policy.train()
        logp = rewrite_logprobs(self.policy, rewrites.sequences, cfg.temperature)
        per_token, clipped = clipped_surrogate(
            logp, rewrites.logprobs, data.advantages[rows], cfg.text_clip, cfg.text_clip
        )
        loss = aggregate(per_token, rewrites.response_mask, "token-mean", shared_count)
        return loss, {
            "loss": float(loss.detach()),
            "clip_ratio": float(clipped.float().mean()),
            "approx_kl": float((rewrites.logprobs - logp.detach()).mean()),
        }

    # ---- sync: both sides' weights, one snapshot
    def rollout_weights(self) -> dict[str, Tensor]:
        return {  # gathered whole when sharded (every rank together)
            **{f"text.{key}": value for key, value in gathered_state(self.policy).items()},
            **{f"image.{key}": value for key, value in gathered_state(self.model).items()},
        }

    def _pair_of(self, weights: dict[str, Tensor], version: int) -> Pair:
        text, image = _split(weights)
        config = msgspec.structs.asdict(self.policy.config)
        engine = LocalEngine(load_rewriter({"model_config": config, "model": text}, self.device))
        engine.version = version
        return engine, sampler_replica(self.model, self.device)(image, version)


def _split(weights: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    sides: dict[str, dict[str, Tensor]] = {"text": {}, "image": {}}
    for key, value in weights.items():
        side, _, name = key.partition(".")
        sides[side][name] = value
    return sides["text"], sides["image"]


def _load_pair(pair: Pair, weights: dict[str, Tensor], version: int) -> None:
    text, image = _split(weights)
    pair[0].update_weights(text, version)
    load_weights(pair[1], image)


__all__ = ["PromptEnhancerConfig", "PromptEnhancerTrainer"]
