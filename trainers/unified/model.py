"""The unified model: one transformer backbone shared by a text track and an image track.

The backbone is the block stack of a :class:`~trainers.diffusion.model.FlowDiT`
(adaLN-Zero blocks). The image track is that FlowDiT itself (patch embedding of the
16×16 image, prompt-attribute tokens, time conditioning, velocity head); the text
track runs the same blocks causally over character embeddings, conditioned by one
learned "text mode" vector instead of a timestep, with a tied vocabulary head.

Two views over the same parameters, so the existing functions work unchanged:

- the model itself is a :class:`~trainers.lm.model.TinyLM` to decoding, the rollout
  engine, held-out greedy evaluation and ``response_logprobs`` (``model(ids)``,
  ``hidden``/``head``, ``generate``, ``config.max_len``);
- ``model.flow`` is a FlowDiT to the samplers, Flow-GRPO and the flow-matching loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from corun.base.errors import CheckpointError
from corun.execution import parallel
from trainers.diffusion.model import FlowDiT, FlowModelConfig, Size
from trainers.lm.model import ModelConfig, TinyLM, refuse_padding
from trainers.lm.tasks import MAX_LEN, VOCAB_SIZE
from trainers.weights import rebuild, warm_start

MODEL_KIND = "unified"  # tagged in checkpoints: a TinyLM or FlowDiT one is refused by name


class UnifiedModelConfig(ModelConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A TinyLM's shape plus the image patch size; saved with checkpoints."""

    patch_size: Size = 4

    def flow_config(self) -> FlowModelConfig:
        return FlowModelConfig(
            patch_size=self.patch_size, d_model=self.d_model, n_layers=self.n_layers,
            n_heads=self.n_heads,
        )  # fmt: skip


class UnifiedModel(TinyLM):
    """Text track: ``model(ids) → logits``. Image track: ``model.flow(x, t, tokens) → v``."""

    def __init__(self, config: UnifiedModelConfig) -> None:
        # Not TinyLM.__init__: its blocks would be a second backbone. The text track
        # inherits TinyLM's forward, tied head and generate, and overrides ``hidden``.
        nn.Module.__init__(self)
        self.config = config
        d = config.d_model
        self.tok = nn.Embedding(config.vocab_size, d)
        self.pos = nn.Embedding(config.max_len, d)
        # The adaLN condition of every block on the text track (the image track's is
        # time + pooled prompt).
        self.text_mode = nn.Parameter(torch.empty(d))
        self.ln_out = nn.LayerNorm(d)
        for weight in (self.tok.weight, self.pos.weight, self.text_mode):
            nn.init.normal_(weight, std=0.02)  # small, as TinyLM: the head is tied
        self.flow = FlowDiT(config.flow_config())

    def hidden(self, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Final hidden states (batch, length, d_model) of the shared blocks, run causally."""
        refuse_padding(attention_mask)
        batch, length = ids.shape
        if length > self.config.max_len:
            raise ValueError(f"sequence of {length} tokens exceeds max_len {self.config.max_len}")
        x = self.tok(ids) + self.pos(torch.arange(length, device=ids.device))
        mode = self.text_mode.expand(batch, -1)
        for block in self.flow.blocks:
            x = block(x, mode, causal=True)
        return self.ln_out(x)

    def track_parameters(self) -> dict[str, list[nn.Parameter]]:
        """Parameters by owner: each track's own, and the shared backbone's."""
        shared = list(self.flow.blocks.parameters())
        ids = {id(p) for p in shared}
        image = [p for p in self.flow.parameters() if id(p) not in ids]
        text = [p for name, p in self.named_parameters() if not name.startswith("flow.")]
        return {"text": text, "image": image, "shared": shared}


def sharded(model: UnifiedModel, strategy: parallel.Strategy) -> UnifiedModel:
    """``model`` spread over the torchrun ranks (FSDP2; nothing at world size 1): a unit
    per shared block, the image track's own layers (``model.flow``, which it enters
    directly), and the text track's around them."""
    parallel.parallelize(
        model, strategy=strategy, blocks=[*model.flow.blocks, model.flow],
        methods=("hidden", "head"),
    )  # fmt: skip
    return model


def build_unified(d_model: int, n_layers: int, n_heads: int, patch_size: int) -> UnifiedModel:
    """A fresh model over the LM tasks' vocabulary; its init draws from the global RNG."""
    config = UnifiedModelConfig(
        vocab_size=VOCAB_SIZE, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
        max_len=MAX_LEN, patch_size=patch_size,
    )  # fmt: skip
    return UnifiedModel(config)


def load_unified(state: dict[str, Any], device: torch.device | str = "cpu") -> UnifiedModel:
    """Rebuild the model of a unified trainer's ``state_dict()`` on ``device``."""
    kind = state.get("model_kind")
    if kind != MODEL_KIND:
        raise ValueError(f"it holds a {kind or 'TinyLM or FlowDiT'} model")
    return rebuild(UnifiedModel, UnifiedModelConfig, state, device)


def unified_from(init_from: str) -> UnifiedModel:
    """Warm start: the model in a checkpoint, given its directory or its run's config."""
    return warm_start(init_from, load_unified, "unified model")


def check_kind(state: dict[str, Any]) -> None:
    """Resume refuses another trainer family's checkpoint before comparing shapes."""
    if state.get("model_kind") != MODEL_KIND:
        raise CheckpointError("checkpoint is not of a unified model (no model_kind 'unified')")
