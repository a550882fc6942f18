"""Prompt enhancer: a small LM rewrites user prompts into the flow model's condition
tokens, and both are trained on the image reward (two tracks, two optimizers).

A rollout samples ``rewrites_per_prompt`` rewrites of each user prompt (the text
group), then ``grpo.samples_per_prompt`` SDE images of each rewrite (the image
group), scored against what the user asked for. A rewrite's reward is the mean
reward of its images, taken per token by default (the colour token is credited
with the colour reward, the place token with the position reward); its advantage is
GRPO's, against the other rewrites of the same prompt. The text track takes a
clipped policy-gradient step on the rewrite tokens; the image track is Flow-GRPO's
(inherited), unless ``freeze_diffusion``. Both honour ``loop.accumulate``:
gradients add up over a window and both optimizers step at its end. A sync
publishes both sides together, so a rollout never pairs a rewriter of one version
with a sampler of another.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

import msgspec
import torch
from torch import Tensor

from corun.data import Dataset
from corun.errors import CheckpointError, ConfigError
from corun.pipeline import is_config
from corun.trainer import Batch, Image, SetupContext
from trainers.common import apply_update, frozen_copy
from trainers.diffusion.flow_rl import ImageGroups, sample_groups
from trainers.diffusion.model import FlowDiT, load_model
from trainers.diffusion.shapes import captions, stable_seed
from trainers.flow_grpo import FlowGRPOConfig, FlowGRPOTrainer
from trainers.lm.engine import LocalEngine, Rollouts
from trainers.lm.model import decode
from trainers.lm.policy import load_policy_state, policy_state
from trainers.pe.prompts import (
    EOS,
    FLOW_BASE,
    REWRITE_LEN,
    UserBatch,
    UserData,
    eval_users,
    flow_tokens,
)
from trainers.pe.rewriter import build_rewriter, load_rewriter, rewrite_logprobs, rewriter_from
from trainers.pg import (
    aggregate,
    clipped_surrogate,
    group_advantages,
    zero_std_groups,
)
from trainers.replicas import Replicas

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
TASK = "prompt-enhancer"  # recorded with the text policy's state
SLOTS = ("color", "shape", "place")  # the rewrite's tokens, in order


class PromptEnhancerConfig(FlowGRPOConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The image track's settings are Flow-GRPO's (init_from, lr, grpo, ...); these
    are the text track's, and the switch that freezes the image track."""

    freeze_diffusion: bool = False
    # Supervised warm start instead of RL: the text policy learns the true rewrites of
    # prompts in plain words only (no synonyms); no images are sampled or trained.
    # RL from its checkpoint (text_init_from) then learns the synonyms from rewards.
    warmup: bool = False
    # Text warm start: a prompt-enhancer checkpoint directory, or a .toml config that
    # corun trains first. Empty: a fresh policy of the shape below.
    text_init_from: str = ""
    text_d_model: PositiveInt = 64
    text_n_layers: PositiveInt = 2
    text_n_heads: PositiveInt = 4
    text_lr: PositiveFloat = 1e-3
    text_grad_clip: NonNegativeFloat = 1.0
    rewrites_per_prompt: Annotated[int, msgspec.Meta(ge=2)] = 4
    temperature: PositiveFloat = 1.0
    text_clip: NonNegativeFloat = 0.2  # PPO-style ratio clip of the text track
    # Which reward each rewrite token is credited with (see _token_rewards).
    text_credit: Literal["factored", "total"] = "factored"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.text_d_model % self.text_n_heads:
            raise ValueError(
                f"`$.text_d_model` ({self.text_d_model}) must be divisible by "
                f"`$.text_n_heads` ({self.text_n_heads})"
            )


@dataclass
class PEBatch:
    rewrites: Rollouts  # rewrites_per_prompt rows per user prompt
    advantages: Tensor  # (N, 3) one per rewrite token
    images: ImageGroups  # samples_per_prompt images per rewrite


Pair = tuple[LocalEngine, FlowDiT]  # a rollout thread's rewriter and sampler


class PromptEnhancerTrainer(FlowGRPOTrainer):
    Config = PromptEnhancerConfig
    config: PromptEnhancerConfig  # type: ignore[assignment]
    accumulates = True

    def prerequisites(self) -> list[str]:
        text = self.config.text_init_from
        return [*super().prerequisites(), *([text] if is_config(text) else [])]

    def setup(self, ctx: SetupContext) -> None:
        super().setup(ctx)  # the image track: flow model, optimizer, sampler, held-out eval
        cfg = self.config
        if cfg.text_init_from:
            self.policy = rewriter_from(cfg.text_init_from)
        else:
            self.policy = build_rewriter(cfg.text_d_model, cfg.text_n_layers, cfg.text_n_heads)
        self.text_optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.text_lr)
        # One snapshot of both sides per sync: a worker never sees them torn apart.
        self.pairs: Replicas[Pair] = Replicas(
            (LocalEngine(self.policy), self.sampler), self._pair_of, _load_pair,
            shared=self.run_config.loop.concurrency > 1, initial=self._weights(),
        )  # fmt: skip
        self.engine = self.pairs.home[0]
        self.eval_users = eval_users(self.held_out.tokens)

    def dataset(self) -> Dataset:
        if self.run_config.data.path:
            raise ConfigError(
                "data.path: the prompt enhancer generates its prompts; leave it empty"
            )
        data = self.run_config.data
        return UserData(data.batch_size, self.run_config.run.seed, plain=self.config.warmup)

    # ---- rollout
    def rollout(self, inputs: UserBatch, step: int) -> Batch:
        if self.config.warmup:  # supervised: the prompts and their true rewrites
            return Batch(inputs, version=self.sampler_version)
        # Every draw of the batch comes from one generator of (seed, step): the same
        # batch on any thread, in any order, and again after a resume.
        cfg, k = self.config, self.config.rewrites_per_prompt
        generator = torch.Generator().manual_seed(stable_seed("pe", self.run_config.run.seed, step))
        (engine, sampler), version = self.pairs.local()
        rewrites = engine.generate(
            inputs.prompt_ids, k, REWRITE_LEN, cfg.temperature, generator=generator
        )
        conditions = flow_tokens(rewrites.response_ids)
        targets = inputs.targets.repeat_interleave(k, dim=0)
        images, image_metrics = sample_groups(
            sampler, conditions, targets, cfg.grpo, cfg.sampling, generator
        )
        # A rewrite earns the mean rewards of the images drawn from it: (N, 3) for
        # its colour, shape and place tokens (see _token_rewards).
        per_token = self._token_rewards(images).view(-1, cfg.grpo.samples_per_prompt, 3).mean(1)
        rewards = images.rewards.view(-1, cfg.grpo.samples_per_prompt).mean(dim=1)
        advantages = torch.stack([
            group_advantages(column, k, cfg.grpo.adv_scope, cfg.grpo.adv_std_norm)
            for column in per_token.unbind(dim=1)
        ], dim=1)  # fmt: skip
        metrics = {
            "rollout/text/reward_mean": float(rewards.mean()),
            "rollout/text/reward_std": float(rewards.std()),
            "rollout/text/zero_std_group_ratio": float(zero_std_groups(rewards, k).float().mean()),
            "rollout/text/rewrite_exact": float((conditions == targets).all(dim=1).float().mean()),
            **{f"rollout/image/{key}": value for key, value in image_metrics.items()},
        }
        return Batch(PEBatch(rewrites, advantages, images), metrics, version=version)

    def _token_rewards(self, images: ImageGroups) -> Tensor:
        """Per image, the reward credited to each rewrite token: "factored" gives the
        colour token the colour reward and the place token the position reward (the
        shape token, unrewarded by itself, the total), so a token's advantage is not
        noise from the others' luck; "total" gives every token the total."""
        if self.config.text_credit == "total" or images.scores is None:
            return images.rewards[:, None].expand(-1, 3)
        scores = images.scores
        return torch.stack([scores.color, scores.total, scores.position], dim=1)

    @property
    def sampler_version(self) -> int:
        return self.pairs.version

    # ---- train
    def train_step(self, batch: Batch) -> dict[str, float]:
        """The text track, then (unless frozen) the image track; each steps its own
        optimizer at the end of the window."""
        if self.config.warmup:
            return self._text_update(batch, *self._supervised_loss(batch.data))
        data: PEBatch = batch.data
        metrics = self._text_update(batch, *self._policy_loss(data))
        if not self.config.freeze_diffusion:
            image = super().train_step(replace(batch, data=data.images))
            metrics |= {key.replace("train/", "train/image/", 1): v for key, v in image.items()}
        return metrics

    def _policy_loss(self, data: PEBatch) -> tuple[Tensor, dict[str, float]]:
        """GRPO's clipped surrogate on the rewrite tokens."""
        cfg, rewrites = self.config, data.rewrites
        self.policy.train()
        logp = rewrite_logprobs(self.policy, rewrites.sequences, cfg.temperature)
        per_token, clipped = clipped_surrogate(
            logp, rewrites.logprobs, data.advantages, cfg.text_clip, cfg.text_clip
        )
        loss = aggregate(per_token, rewrites.response_mask, "token-mean")
        return loss, {
            "clip_ratio": float(clipped.float().mean()),
            "approx_kl": float((rewrites.logprobs - logp.detach()).mean()),
        }

    def _supervised_loss(self, users: UserBatch) -> tuple[Tensor, dict[str, float]]:
        """Cross-entropy of the true rewrites (the warm start)."""
        self.policy.train()
        sequences = torch.cat([users.prompt_ids, users.targets + FLOW_BASE], dim=1)
        return -rewrite_logprobs(self.policy, sequences, 1.0).mean(), {}

    def _text_update(
        self, batch: Batch, loss: Tensor, metrics: dict[str, float]
    ) -> dict[str, float]:
        """Accumulate ``loss`` over the window; step the text optimizer at its end."""
        if batch.window_pos == 0:
            self.text_optimizer.zero_grad(set_to_none=True)
        (loss / batch.window_size).backward()
        metrics["loss"] = float(loss.detach())
        if batch.ends_window:
            params, clip = self.policy.parameters(), self.config.text_grad_clip
            metrics["grad_norm"] = apply_update(params, self.text_optimizer, clip)
        return {f"train/text/{key}": value for key, value in metrics.items()}

    # ---- sync
    def sync_weights(self, version: int) -> None:
        self.pairs.sync(self._weights(), version)

    def _weights(self) -> dict[str, Tensor]:
        return {
            **{f"text.{key}": value for key, value in self.policy.state_dict().items()},
            **{f"image.{key}": value for key, value in self.model.state_dict().items()},
        }

    def _pair_of(self, weights: dict[str, Tensor], version: int) -> Pair:
        text, image = _split(weights)
        engine = LocalEngine(load_rewriter(_state(self.policy, text)))
        engine.version = version
        return engine, frozen_copy(load_model(_state(self.model, image)))

    # ---- evaluation
    def evaluate(self, step: int | None = None) -> dict[str, float | Image]:
        """Greedy rewrites of held-out user prompts, ODE images of the rewrites from
        fixed noise, scored against what the users asked for; with ``step``, a grid
        captioned "user prompt -> rewrite"."""
        cfg, users = self.config, self.eval_users
        self.policy.eval()
        self.model.eval()
        ids = decode(self.policy, users.prompt_ids, REWRITE_LEN, stop_id=EOS).tokens
        rewrites = flow_tokens(ids)
        labels = [f"{u} -> {r}" for u, r in zip(users.texts, captions(rewrites), strict=True)]
        hits = (rewrites == users.targets).float()
        # Per slot too: the shape is not rewarded, so only colour and place can learn.
        metrics: dict[str, float | Image] = {
            "eval/rewrite_exact": float(hits.all(dim=1).float().mean()),
            **{f"eval/rewrite_{slot}": float(hits[:, i].mean()) for i, slot in enumerate(SLOTS)},
        }
        metrics |= self.held_out.samples(
            self.model, num_steps=cfg.sample_steps, shift=cfg.shift, cfg_scale=cfg.cfg_scale,
            step=step, conditions=rewrites, labels=labels,
        )  # fmt: skip
        if step is not None and cfg.grid_size:
            path = self.held_out.grid_path(step)
            metrics["eval/samples"] = Image(path, f"step {step}: user prompt -> rewrite")
        return metrics

    # ---- observability and resume
    def wandb_extra(self) -> dict[str, Any]:
        return super().wandb_extra() | {"model/text_num_params": self.policy.num_params()}

    def state_dict(self) -> dict[str, Any]:
        return {
            "text": policy_state(self.policy, self.text_optimizer, TASK),
            "image": super().state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not {"text", "image"} <= state.keys():
            raise CheckpointError(
                f"not a prompt-enhancer checkpoint: it holds {sorted(state)}, "
                "not a 'text' and an 'image' side"
            )
        load_policy_state(state["text"], self.policy, self.text_optimizer, TASK)
        super().load_state_dict(state["image"])


def _split(weights: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    sides: dict[str, dict[str, Tensor]] = {"text": {}, "image": {}}
    for key, value in weights.items():
        side, _, name = key.partition(".")
        sides[side][name] = value
    return sides["text"], sides["image"]


def _state(model: Any, weights: dict[str, Tensor]) -> dict[str, Any]:
    return {"model_config": msgspec.structs.asdict(model.config), "model": weights}


def _load_pair(pair: Pair, weights: dict[str, Tensor], version: int) -> None:
    text, image = _split(weights)
    pair[0].update_weights(text, version)
    with torch.no_grad():
        pair[1].load_state_dict(image)


__all__ = ["PromptEnhancerConfig", "PromptEnhancerTrainer"]
