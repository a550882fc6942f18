"""Pretraining the unified model: both tracks supervised, one optimizer step per batch.

A batch holds a text SFT batch (teacher-forced cross-entropy on the task's answers,
:func:`trainers.sft.masked_loss_sum`) and a flow-matching batch of shapes images
(:func:`trainers.diffusion.sampling.flow_matching_loss`, its noise, times and
condition dropout drawn by :func:`trainers.flow_pretrain.flow_batch`); the weighted
sum of the two losses is backpropagated once and applied in one optimizer step. Its
checkpoints warm-start the unified RL trainer.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import torch

from corun.trainer import Batch, SetupContext
from trainers.common import apply_update
from trainers.diffusion.sampling import flow_matching_loss
from trainers.diffusion.shapes import stable_seed
from trainers.flow_pretrain import FlowBatch, flow_batch
from trainers.lm.tasks import TokenBatch, encode_examples
from trainers.sft import masked_loss_sum
from trainers.unified.base import Tracks, UnifiedBase, UnifiedSettings
from trainers.unified.model import build_unified


class UnifiedPretrainConfig(UnifiedSettings, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # Share of image prompts replaced by the empty prompt (classifier-free guidance).
    cond_dropout: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.1


class UnifiedPretrainTrainer(UnifiedBase[UnifiedPretrainConfig]):
    Config = UnifiedPretrainConfig

    def setup(self, ctx: SetupContext) -> None:
        # The runtime has seeded the global RNGs with run.seed: the model init draws from them.
        cfg = self.config
        self.build(ctx, build_unified(cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.patch_size))

    def rollout(self, inputs: Tracks[Any, Any], step: int) -> Batch:
        """The build phase: tokenise the text, draw the flow-matching randomness."""
        generator = torch.Generator().manual_seed(
            stable_seed("unified-noise", self.run_config.run.seed, step)
        )
        image = flow_batch(inputs.image, generator, self.config.cond_dropout)
        return Batch(Tracks(encode_examples(inputs.text), image))

    def train_step(self, batch: Batch) -> dict[str, float]:
        cfg = self.config
        text: TokenBatch = batch.data.text
        image: FlowBatch = batch.data.image
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        text_loss = masked_loss_sum(self.model(text.inputs), text) / text.loss_mask.sum()
        image_loss = flow_matching_loss(
            self.model.flow, image.images, image.tokens, image.t, image.noise
        )
        loss = cfg.text_weight * text_loss + cfg.image_weight * image_loss
        loss.backward()
        grad_norm = apply_update(self.model.parameters(), self.optimizer, cfg.grad_clip)
        return {
            "train/loss": float(loss.detach()),
            "train/text/loss": float(text_loss.detach()),
            "train/image/loss": float(image_loss.detach()),
            "train/grad_norm": grad_norm,
        }
