"""Pretraining the unified model: both tracks supervised, one optimizer step per batch.

A batch holds a text SFT batch (teacher-forced cross-entropy on the task's answers,
:func:`trainers.lm.sft.masked_loss_sum`) and a flow-matching batch of shapes images
(:func:`trainers.diffusion.sampling.flow_matching_loss`, its noise, times and
condition dropout drawn by :func:`trainers.diffusion.pretrain.flow_batch`); the loss is
the weighted sum of the two, one optimizer step per update. Its checkpoints
warm-start the unified RL trainer. Under torchrun each track's loss is a mean over
every rank's answer tokens or pixels (``corun.shared_count``).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from torch import Tensor

from corun import Batch, Part, RolloutContext, SetupContext, shared_count
from trainers.diffusion.pretrain import FlowBatch, flow_batch
from trainers.diffusion.sampling import flow_matching_loss
from trainers.lm.sft import masked_loss_sum
from trainers.lm.tasks import TokenBatch, encode_examples
from trainers.unified.base import Tracks, UnifiedBase, UnifiedSettings
from trainers.unified.model import build_unified
from trainers.weights import to_device


class UnifiedPretrainConfig(UnifiedSettings, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # Share of image prompts replaced by the empty prompt (classifier-free guidance).
    cond_dropout: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.1


class UnifiedPretrainTrainer(UnifiedBase[UnifiedPretrainConfig]):
    Config = UnifiedPretrainConfig
    data_parallel = True  # both tracks' means divide by the shared count

    def setup(self, ctx: SetupContext) -> None:
        # The runtime has seeded the global RNGs with run.seed: the model init draws from them.
        cfg = self.config
        self.build(ctx, build_unified(cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.patch_size))

    def rollout(self, inputs: Tracks[Any, Any], ctx: RolloutContext) -> Batch:
        """The build phase: tokenise the text, draw the flow-matching randomness."""
        image = flow_batch(inputs.image, ctx.generator, self.config.cond_dropout)
        return Batch(Tracks(encode_examples(inputs.text), image))

    def prepare(self, batch: Batch) -> Tracks[TokenBatch, FlowBatch]:
        """Both tracks' batches (built on the CPU) to the model's device, once."""
        return to_device(batch.data, self.device)

    def loss(self, batch: Batch, part: Part) -> tuple[Tensor, dict[str, float]]:
        cfg = self.config
        text: TokenBatch = batch.data.text
        image: FlowBatch = batch.data.image
        text = text.rows(part.mini_rows(len(text)))
        image = image.rows(part.mini_rows(len(image)))
        self.model.train()
        tokens = shared_count(text.loss_mask.sum())
        text_loss = masked_loss_sum(self.model(text.inputs), text) / tokens
        image_loss = flow_matching_loss(
            self.model.flow, image.images, image.tokens, image.t, image.noise, shared_count
        )
        loss = cfg.text_weight * text_loss + cfg.image_weight * image_loss
        return loss, {
            "text/loss": float(text_loss.detach()),
            "image/loss": float(image_loss.detach()),
        }
