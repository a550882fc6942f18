"""Policy-gradient math shared by every RL trainer (LM GRPO/PPO, diffusion Flow-GRPO).

Pure tensor functions, tested in isolation: group-normalised advantages, the
clipped-ratio surrogate with separate low/high clip (DAPO clip-higher), loss
aggregation modes, the k3 KL estimator, GAE, and the clipped value loss.

Shapes: ``B`` sequences (``groups × group_size`` for GRPO), ``T`` response tokens
(or denoising steps); ``mask`` is 1 on tokens that count.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

AdvantageScope = Literal["group", "batch"]
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


def group_advantages(
    rewards: Tensor, group_size: int, scope: AdvantageScope = "group", std_norm: bool = True,
    eps: float = 1e-6,
) -> Tensor:  # fmt: skip
    """GRPO advantages: reward minus its group's mean, optionally over a std.

    ``scope`` picks where the std comes from: each group's own ("group", as in
    GRPO) or the whole batch ("batch", steadier when groups are small). The
    baseline is always the group mean, so a group of equal rewards gets zero.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if std_norm:
        std = grouped.std(dim=1, keepdim=True) if scope == "group" else rewards.std()
        centred = centred / (std + eps)
    return centred.reshape(-1)


def zero_std_groups(rewards: Tensor, group_size: int) -> Tensor:
    """A bool per group: all rewards equal, so the group carries no learning signal."""
    grouped = rewards.view(-1, group_size)
    return (grouped == grouped[:, :1]).all(dim=1)


def clipped_surrogate(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """Per-token PPO loss ``max(-A·r, -A·clip(r, 1-low, 1+high))`` and where clipping bit.

    ``advantages`` broadcasts against ``logp`` (one per sequence: shape (B, 1)).
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped)


def decoupled_surrogate(
    logp: Tensor, proximal_logp: Tensor, behaviour_logp: Tensor, advantages: Tensor,
    clip_low: float, clip_high: float, cap: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Off-policy correction for stale batches (decoupled PPO).

    Clipping is taken against the proximal policy (the weights before this batch's
    updates), and the behaviour policy that generated the batch enters only through
    an importance weight ``π_prox / π_behav``, capped at ``cap`` so one very stale
    token cannot dominate. On-policy (behaviour == proximal) it is the plain clipped
    surrogate. Returns (per-token loss, where clipping bit, the weights).
    """
    weights = torch.exp(proximal_logp - behaviour_logp).clamp(max=cap).detach()
    loss, clipped = clipped_surrogate(logp, proximal_logp, advantages, clip_low, clip_high)
    return weights * loss, clipped, weights


def aggregate(loss: Tensor, mask: Tensor, mode: LossAggregation) -> Tensor:
    """Reduce per-token losses (B, T) to a scalar.

    token-mean: every token weighs the same (long answers weigh more);
    seq-mean-token-mean: every sequence weighs the same (GRPO's original);
    seq-mean-token-sum: sums over tokens, then means over sequences (Dr. GRPO style).
    """
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        return (loss * mask).sum() / mask.sum().clamp(min=1)
    per_sequence = (loss * mask).sum(dim=1)
    if mode == "seq-mean-token-mean":
        per_sequence = per_sequence / mask.sum(dim=1).clamp(min=1)
    return per_sequence.mean()


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token KL(policy || reference) estimate ``exp(d) - d - 1`` with ``d = ref - logp``:
    unbiased and never negative."""
    delta = ref_logp - logp
    # expm1 keeps the small differences of near-on-policy training exact in float32.
    return (torch.expm1(delta) - delta).clamp(min=0.0)


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over right-padded sequences (B, T).

    ``rewards[b, t]`` is the reward after token ``t``; past the last real token the
    value is 0. Returns (advantages, returns), both masked to zero on padding.
    """
    mask = mask.to(values.dtype)
    values = values * mask
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        next_value = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        advantages[:, t] = running
    return advantages, (advantages + values) * mask


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float) -> Tensor:
    """Per-token ``0.5 · max((v − R)², (clip(v, v_old ± c) − R)²)``."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
