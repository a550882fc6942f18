"""RL on the unified model: GRPO on the text track and Flow-GRPO on the image track,
both losses accumulated into one optimizer step.

Rollout samples, from the rollout copy of the model (a :class:`LocalEngine`, whose
``model.flow`` is the image sampler), ``samples_per_prompt`` answers per text prompt
scored by the task's reward, and ``samples_per_prompt`` SDE images per image prompt
scored by the pixel rewards (:func:`trainers.diffusion.flow_rl.sample_groups`); both
get group advantages. The loss is the text track's clipped loss (with the first
micro-batch) plus the image track's, one trained denoising step per micro-batch
(:func:`trainers.diffusion.flow_rl.flow_grpo_step_loss`), each times its track weight;
the runtime applies one update per window.

Under torchrun each rank samples whole groups of both tracks (its shard of the
prompts) and each track's loss is a mean over every rank's tokens or images
(``corun.shared_count``); batch-scoped advantages and random trained steps, which
need the whole batch, are refused there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

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
from trainers.diffusion.shapes import ShapeBatch
from trainers.lm.engine import LocalEngine, Rollouts
from trainers.lm.policy_gradient import clipped_policy_loss
from trainers.lm.rl import task_rewards
from trainers.lm.tasks import Task, encode_prompts
from trainers.pg import (
    AdvantageScope,
    LossAggregation,
    check_scope_shardable,
    group_advantages,
    zero_std_groups,
)
from trainers.unified.base import Tracks, UnifiedBase, UnifiedSettings, tagged
from trainers.unified.model import (
    MODEL_KIND,
    UnifiedModel,
    build_unified,
    load_unified,
    unified_from,
)
from trainers.weights import (
    Replicas,
    ReplicatedRollouts,
    gathered_state,
    kl_anchor,
    to_device,
    warm_start_runs,
    whole_copy,
)

NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]


class TextGRPOSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How the text track samples and learns (GRPO, as trainers/grpo.py)."""

    samples_per_prompt: Annotated[int, msgspec.Meta(ge=2)] = 8
    temperature: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    clip_low: NonNegativeFloat = 0.2
    clip_high: NonNegativeFloat = 0.2
    loss_agg: LossAggregation = "token-mean"
    adv_scope: AdvantageScope = "group"
    adv_std_norm: bool = True
    # Memory: the most logits one log-prob pass holds at once (trainer.logits_chunk).
    logits_chunk: Annotated[int, msgspec.Meta(ge=0)] = 1 << 24


class UnifiedConfig(UnifiedSettings, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # Warm start: a checkpoint directory, or the .toml config of a run that corun
    # trains first when its final checkpoint is missing. Empty: a fresh model.
    init_from: str = ""
    lr: Annotated[float, msgspec.Meta(gt=0)] = 3e-4
    text: TextGRPOSettings = TextGRPOSettings()  # [trainer.text]
    image: FlowGRPOSettings = FlowGRPOSettings()  # [trainer.image]: Flow-GRPO's settings


@dataclass
class TextGroups:
    rollouts: Rollouts
    advantages: Tensor  # (N,) one per response

    def __len__(self) -> int:
        return len(self.advantages)


def score_text(
    task: Task, examples: list[tuple[str, str]], rollouts: Rollouts, settings: TextGRPOSettings
) -> tuple[TextGroups, dict[str, float]]:
    """Task rewards of each prompt's group of responses (on the CPU), and group
    advantages (on the rollouts' device, where the loss uses them)."""
    n = settings.samples_per_prompt
    rewards, metrics = task_rewards(task, examples, rollouts, n)
    advantages = group_advantages(rewards, n, settings.adv_scope, settings.adv_std_norm)
    metrics["zero_std_group_ratio"] = float(zero_std_groups(rewards, n).float().mean())
    return TextGroups(rollouts, to_device(advantages, rollouts.response_ids.device)), metrics


class UnifiedTrainer(ReplicatedRollouts, UnifiedBase[UnifiedConfig]):
    """Registered as ``unified``."""

    Config = UnifiedConfig
    data_parallel = True  # rows are whole groups; both tracks' means use shared_count

    def setup(self, ctx: SetupContext) -> None:
        cfg = self.config
        check_scope_shardable(cfg.text.adv_scope, "text.adv_scope")
        check_data_parallel(cfg.image, "image")
        if cfg.init_from:
            model = unified_from(cfg.init_from)
        else:
            model = build_unified(cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.patch_size)
        model.to(ctx.device)  # before the copies below: every copy on the run's device
        whole = whole_copy(model) or model  # before sharding: the rollout side's is whole
        self.build(ctx, model)
        # The image track's KL anchor: the starting model, frozen.
        self.reference = kl_anchor(whole.flow, cfg.image.kl_coef)
        # The rollout copy of the whole model (both tracks), replaced only by a sync;
        # rollout workers on other threads (concurrency > 1) keep replicas of it.
        self.replicas: Replicas[LocalEngine] = Replicas(
            LocalEngine(whole), self._replica, LocalEngine.update_weights,
            initial=self.rollout_weights(), ctx=ctx,
        )  # fmt: skip
        self.engine = self.replicas.home
        self.max_new_tokens = self.task.max_answer_len + 1

    def prerequisites(self) -> list[str]:
        return warm_start_runs(self.config.init_from)

    # ---- rollout
    def rollout(
        self, inputs: Tracks[list[tuple[str, str]], ShapeBatch], ctx: RolloutContext
    ) -> Batch:
        """Both tracks' groups, every draw from the rollout's generator."""
        cfg, generator = self.config, ctx.generator
        engine = self.replicas.local(ctx.version)[0]
        # Both tracks' prompts (encoded on the CPU) to the model's device, once; the
        # rewards are scored on the CPU.
        prompts = to_device(
            Tracks(encode_prompts([prompt for prompt, _ in inputs.text]), inputs.image.tokens),
            self.device,
        )
        rollouts = engine.generate(
            prompts.text, cfg.text.samples_per_prompt, self.max_new_tokens,
            cfg.text.temperature, cfg.text.top_p, generator,
        )  # fmt: skip
        text, text_metrics = score_text(self.task, inputs.text, rollouts, cfg.text)
        sampling = Sampling(cfg.sample_steps, cfg.shift, cfg.cfg_scale)
        assert isinstance(engine.model, UnifiedModel)  # the engine's copy of the model
        image, image_metrics = sample_groups(
            engine.model.flow, prompts.image, inputs.image.tokens, cfg.image, sampling, generator
        )
        metrics = tagged("rollout", "text", text_metrics)
        metrics |= tagged("rollout", "image", image_metrics)
        return Batch(Tracks(text, image), metrics, version=engine.version)

    def _replica(self, state: dict[str, Tensor], version: int) -> LocalEngine:
        config = msgspec.structs.asdict(self.model.config)
        saved = {"model_config": config, "model": state, "model_kind": MODEL_KIND}
        model = load_unified(saved, self.device)
        engine = LocalEngine(model)
        engine.version = version
        return engine

    # ---- train: the text loss with the first micro-batch; one image step per micro-batch
    def micro_batches(self, batch: Batch) -> int:
        return len(batch.data.image.steps)

    def loss(self, batch: Batch, part: Part) -> tuple[Tensor, dict[str, float]]:
        cfg = self.config
        text: TextGroups = batch.data.text
        image: ImageGroups = batch.data.image
        image = image.rows(part.mini_rows(len(image)))
        self.model.train()
        metrics: dict[str, float] = {}
        loss = torch.zeros((), device=self.device)
        if part.micro == 0:
            rows = part.mini_rows(len(text))
            text_loss, text_metrics, _ = clipped_policy_loss(
                self.model, text.rollouts.select(rows), text.advantages[rows, None], cfg.text
            )
            loss = loss + cfg.text_weight * text_loss
            text_metrics["loss"] = float(text_loss.detach())
            metrics |= {f"text/{key}": value for key, value in text_metrics.items()}
        step_loss, image_metrics = flow_grpo_step_loss(
            self.model.flow, self.reference, image, image.steps[part.micro], cfg.image,
            shared_count,
        )  # fmt: skip
        loss = loss + cfg.image_weight * step_loss / part.micros
        image_metrics["loss"] = float(step_loss.detach())
        metrics |= {f"image/{key}": value for key, value in image_metrics.items()}
        return loss, metrics

    # ---- sync: the rollout copy takes the trained weights
    def rollout_weights(self) -> dict[str, Tensor]:
        """The trained weights; when sharded, gathered whole (every rank together)."""
        return gathered_state(self.model)
