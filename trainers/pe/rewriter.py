"""The text policy of the prompt enhancer: a TinyLM whose rewrites obey a grammar.

After the separator it may only write a colour token, then a shape token, then a
place token (a logit mask keyed on the previous token), so every rewrite is a valid
condition for the flow model and RL learns which one, not the format. The mask lives
in ``forward``, which both sampling (:func:`trainers.lm.model.decode`) and
:func:`rewrite_logprobs` go through, so behaviour and trained log-probs agree.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from trainers.diffusion import shapes
from trainers.lm.model import ModelConfig, TinyLM
from trainers.pe.prompts import EOS, FLOW_BASE, PROMPT_LEN, REWRITE_LEN, SEP, VOCAB_SIZE
from trainers.weights import rebuild, warm_start

_BLOCKED = -1e9  # finite, so masked logits never turn a softmax into NaN


@functools.cache
def grammar(device: torch.device) -> Tensor:
    """(V, V) on ``device`` (made once per device): row = previous token, column = next
    token; 0 allowed, _BLOCKED not."""
    colors, shape_ids, places = (
        range(FLOW_BASE + offset, FLOW_BASE + offset + size)
        for offset, size in zip(
            (1, 1 + len(shapes.COLORS), 1 + len(shapes.COLORS) + len(shapes.SHAPES)),
            (len(shapes.COLORS), len(shapes.SHAPES), len(shapes.PLACES)),
            strict=True,
        )
    )
    mask = torch.zeros(VOCAB_SIZE, VOCAB_SIZE, device=device)
    order = ([SEP], colors), (colors, shape_ids), (shape_ids, places), (places, [EOS])
    for previous, allowed in order:
        rows = torch.tensor(list(previous), device=device)
        mask[rows] = _BLOCKED
        mask[rows[:, None], torch.tensor(list(allowed), device=device)] = 0.0
    return mask


class RewriterLM(TinyLM):
    """TinyLM with the rewrite grammar applied to its next-token logits."""

    def forward(self, ids: Tensor) -> Tensor:
        return super().forward(ids) + grammar(ids.device)[ids]


def build_rewriter(d_model: int, n_layers: int, n_heads: int) -> RewriterLM:
    """A fresh policy; its init draws from the global torch RNG (seeded by the runtime)."""
    config = ModelConfig(
        vocab_size=VOCAB_SIZE, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
        max_len=PROMPT_LEN + REWRITE_LEN,
    )  # fmt: skip
    return RewriterLM(config)


def load_rewriter(state: dict[str, Any], device: torch.device | str = "cpu") -> RewriterLM:
    """The policy of a ``model_config`` + ``model`` state over this vocabulary, on ``device``."""
    if state["model_config"]["vocab_size"] != VOCAB_SIZE:
        raise ValueError(f"vocabulary of {state['model_config']['vocab_size']}, not {VOCAB_SIZE}")
    return rebuild(RewriterLM, ModelConfig, state, device)


def rewriter_from(init_from: str) -> RewriterLM:
    """Warm start: the text policy of a prompt-enhancer checkpoint (or its run's config)."""
    return warm_start(init_from, lambda state: load_rewriter(state["text"]), "prompt-enhancer")


def rewrite_logprobs(model: RewriterLM, sequences: Tensor, temperature: float) -> Tensor:
    """Log-probs (N, REWRITE_LEN) of the rewrite tokens of ``sequences`` (prompt +
    rewrite), under the tempered, grammar-masked distribution that sampled them."""
    logits = model(sequences[:, :-1])[:, PROMPT_LEN - 1 :] / temperature
    return F.log_softmax(logits, dim=-1).gather(-1, sequences[:, PROMPT_LEN:, None]).squeeze(-1)
