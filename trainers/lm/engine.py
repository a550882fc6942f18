"""An in-process rollout engine for TinyLM: batched sampling with its own weights.

The engine holds a copy of the policy that only ``update_weights`` replaces, so it
never reads weights while the trainer is changing them (the same contract a vLLM or
SGLang server has behind its weight-update endpoint). It samples ``n`` responses
per prompt with temperature and top-p, records each token's behaviour log-prob and
the weight version that produced it, and stops at EOS or ``max_new_tokens``. It
samples on its weights' device (the run's), where its rollouts stay.

What happens to a generation in flight when newer weights are published is the
engine's capability, chosen by the caller: it finishes on the weights it started
with ("drain"), or takes the new weights between two decode steps and continues from
the prefix ("interrupt": a partial rollout whose tokens carry different versions).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trainers.lm.model import TinyLM, decode
from trainers.lm.tasks import EOS, PAD
from trainers.weights import to_device

NEVER = -1  # a stop id no token has: decoding runs to its length


@dataclass
class Rollouts:
    """``n`` sampled responses per prompt, prompt-major (rows ``i*n .. i*n+n-1``)."""

    prompt_ids: Tensor  # (N, P)
    response_ids: Tensor  # (N, T), PAD after the EOS
    response_mask: Tensor  # (N, T) bool: generated tokens, EOS included
    logprobs: Tensor  # (N, T) behaviour log-probs, 0 on padding
    truncated: Tensor  # (N,) bool: hit max_new_tokens without an EOS
    token_versions: Tensor  # (N, T) weight version that produced each token
    version: int  # the oldest of those: what the batch's staleness is counted from
    # (N, P) bool: the real tokens of prompts left-padded to one length (prompts of
    # several lengths); None when every prompt has all P tokens.
    prompt_mask: Tensor | None = None

    @property
    def sequences(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor | None:
        """(N, P + T) real tokens of :attr:`sequences` (None: all of them)."""
        if self.prompt_mask is None:
            return None
        return torch.cat([self.prompt_mask, torch.ones_like(self.response_mask)], dim=1)

    def select(self, rows: Tensor | slice) -> Rollouts:
        return Rollouts(
            self.prompt_ids[rows], self.response_ids[rows], self.response_mask[rows],
            self.logprobs[rows], self.truncated[rows], self.token_versions[rows], self.version,
            None if self.prompt_mask is None else self.prompt_mask[rows],
        )  # fmt: skip

    def response_ends(self) -> Tensor:
        """(N,) each row's response up to its last trained token (0: none)."""
        mask = self.response_mask
        positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
        return torch.where(mask, positions, 0).amax(dim=1)

    def prompt_lengths(self) -> Tensor:
        """(N,) each row's prompt without its left padding."""
        ids = self.prompt_ids
        if self.prompt_mask is None:
            return torch.full((ids.shape[0],), ids.shape[1], device=ids.device)
        return self.prompt_mask.sum(dim=1)

    def row_tokens(self) -> list[int]:
        """What each row costs a forward pass cut to it: its prompt and its response up
        to the last trained token."""
        lengths: list[int] = (self.prompt_lengths() + self.response_ends()).tolist()
        return lengths

    def trimmed(self) -> Rollouts:
        """The same rows without the columns none of them needs: the prompts' shared
        left padding and the responses past the last trained token (at least one).
        Causal attention: what a kept position computes does not change."""
        width = max(1, int(self.response_ends().max()))
        start = self.prompt_ids.shape[1] - int(self.prompt_lengths().max())
        return Rollouts(
            self.prompt_ids[:, start:], self.response_ids[:, :width],
            self.response_mask[:, :width], self.logprobs[:, :width], self.truncated,
            self.token_versions[:, :width], self.version,
            None if self.prompt_mask is None else self.prompt_mask[:, start:],
        )  # fmt: skip

    def spans_versions(self) -> Tensor:
        """(N,) bool: rows whose tokens came from more than one version (partial rollouts)."""
        versions = self.token_versions.masked_fill(~self.response_mask, self.version)
        return versions.amax(dim=1) > versions.amin(dim=1)

    @staticmethod
    def concat(parts: list[Rollouts]) -> Rollouts:
        if len({p.prompt_ids.shape[1] for p in parts}) > 1 or any(
            p.prompt_mask is not None for p in parts
        ):
            raise ValueError("concatenating left-padded prompts is not supported")
        width = max(p.response_ids.shape[1] for p in parts)
        return Rollouts(
            torch.cat([p.prompt_ids for p in parts]),
            torch.cat([_pad(p.response_ids, width, PAD) for p in parts]),
            torch.cat([_pad(p.response_mask, width, False) for p in parts]),
            torch.cat([_pad(p.logprobs, width, 0.0) for p in parts]),
            torch.cat([p.truncated for p in parts]),
            torch.cat([_pad(p.token_versions, width, p.version) for p in parts]),
            min(p.version for p in parts),
        )


def _pad(t: Tensor, width: int, value: Any) -> Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)


class LocalEngine:
    """Samples from its own copy of the policy; ``update_weights`` is the only writer."""

    def __init__(self, policy: TinyLM) -> None:
        self.model = copy.deepcopy(policy).eval()
        self.version = 0

    @property
    def device(self) -> torch.device:
        """Where the engine's weights are (the policy's: the run's device), and so where
        it samples and its rollouts are."""
        return next(self.model.parameters()).device

    def update_weights(self, state: dict[str, Tensor], version: int) -> None:
        with torch.no_grad():
            self.model.load_state_dict(state)
        self.version = version

    def generate(
        self,
        prompt_ids: Tensor,
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        newer_weights: Callable[[], tuple[int, dict[str, Tensor]]] | None = None,
        stop: bool = True,
    ) -> Rollouts:
        """Sample; with ``newer_weights`` (interrupt mode) the engine asks it for the
        latest published (version, weights) between decode steps and switches to them.
        Without ``stop`` an EOS ends nothing: every row runs to ``max_new_tokens``.
        ``prompt_ids`` may be built on the CPU: they go to the engine's device once."""
        prompts = to_device(prompt_ids, self.device).repeat_interleave(n, dim=0)

        def weights_version() -> int:
            if newer_weights is not None:
                version, state = newer_weights()
                if version != self.version:
                    self.update_weights(state, version)
            return self.version

        out = decode(
            self.model, prompts, max_new_tokens, stop_id=EOS if stop else NEVER,
            temperature=temperature,
            top_p=top_p, generator=generator, weights_version=weights_version,
        )  # fmt: skip
        is_eos = out.tokens == (EOS if stop else NEVER)
        # A token counts up to and including the first EOS.
        eos_before = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
        mask = ~eos_before
        token_versions = out.versions.expand_as(out.tokens).masked_fill(~mask, out.versions[-1])
        return Rollouts(
            prompt_ids=prompts,
            response_ids=out.tokens.masked_fill(~mask, PAD),
            response_mask=mask,
            logprobs=out.logprobs.masked_fill(~mask, 0.0),
            truncated=~is_eos.any(dim=1),
            token_versions=token_versions,
            version=int(out.versions[0]),
        )
