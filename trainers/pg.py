"""Policy-gradient math shared by every RL trainer (LM GRPO/PPO, diffusion Flow-GRPO).

Pure tensor functions, tested in isolation: group-normalised advantages, the
clipped-ratio surrogate with separate low/high clip (DAPO clip-higher) and optional
dual clip, loss aggregation modes, the k3 KL estimator, GAE, and the clipped value
loss. tests/test_pg_reference*.py checks each against an independent reference
written from verl's ``core_algos`` semantics; where these functions differ from it
on purpose, the docstring says so and why.

Shapes: ``B`` sequences (``groups × group_size`` for GRPO), ``T`` response tokens
(or denoising steps); ``mask`` is 1 on tokens that count (any layout: left or right
padding, holes, rows with no tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch
from torch import Tensor

from corun import ConfigError, world

AdvantageScope = Literal["group", "batch"]
LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """``rewards`` as (groups, group_size), prompt-major, or a ValueError for the caller."""
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.reshape(-1, group_size)


def fill_failed(rewards: Tensor, ok: Tensor, group_size: int) -> Tensor:
    """Rows that failed (``ok`` False: an environment or a reward function failed) take
    the mean reward of their group's rows that did not, so they move no advantage (a
    group with no good rows: 0). Their tokens are masked out by the caller."""
    grouped, good = _grouped(rewards.clone(), group_size), _grouped(ok, group_size)
    count = good.sum(dim=1, keepdim=True)
    mean = (grouped * good).sum(dim=1, keepdim=True) / count.clamp(min=1)
    return torch.where(good, grouped, mean.expand_as(grouped)).flatten()


def check_scope_shardable(scope: AdvantageScope, key: str) -> None:
    """Refuse (one line, ``key`` the setting's path under ``$.trainer``) a batch-wide
    advantage normalisation under torchrun: each rank sees only its shard of the batch."""
    if scope == "batch" and world().parallel:
        raise ConfigError(
            f'`$.trainer.{key}` = "batch": not under data-parallel training yet (each rank '
            'would normalise by its own shard); use "group" or run.nproc = 1'
        )


def group_advantages(
    rewards: Tensor, group_size: int, scope: AdvantageScope = "group", std_norm: bool = True,
    eps: float = 1e-6,
) -> Tensor:  # fmt: skip
    """GRPO advantages: reward minus its group's mean, optionally over ``std + eps``.

    ``scope`` picks where the (unbiased) std comes from: each group's own ("group", as
    in GRPO) or the whole batch ("batch", steadier when groups are small). The
    baseline is always the group mean.

    A group of equal rewards gets exactly 0, whatever the scope, the dtype and the
    other groups in the batch. A group of one (``group_size`` 1) is such a group:
    all zeros. verl gives it mean 0 and std 1 instead (the raw reward, REINFORCE
    without a baseline), a different estimator that callers should pick by name,
    not by a degenerate group size; corun's trainers refuse group size 1 anyway.
    """
    if scope not in get_args(AdvantageScope):
        raise ValueError(f"unknown advantage scope {scope!r}")
    grouped = _grouped(rewards, group_size)
    if group_size == 1 or rewards.numel() == 0:  # a std of one value is NaN (and a warning)
        return torch.zeros_like(rewards).reshape(-1)
    # float64 because in float32 the mean of eight 0.3s is one rounding step off 0.3,
    # and near-equal rewards lose every digit to cancellation. Rewards are one value
    # per sequence, so the wider type costs nothing measurable.
    wide = grouped.double()
    centred = wide - wide.mean(dim=1, keepdim=True)
    if std_norm:
        std = wide.std(dim=1, keepdim=True) if scope == "group" else wide.std()
        centred = centred / (std + eps)
    # Exact zero for flat groups comes from asking which groups are flat, not from
    # arithmetic: even in float64 the mean of three 0.1s is not 0.1, and dividing
    # that residue by std + eps ≈ 1e-6 turned it into an advantage (0.03 in float32).
    centred = centred.masked_fill(zero_std_groups(rewards, group_size)[:, None], 0.0)
    return centred.reshape(-1).to(rewards.dtype)


def zero_std_groups(rewards: Tensor, group_size: int) -> Tensor:
    """A bool per group: all rewards equal, so the group carries no learning signal."""
    grouped = _grouped(rewards, group_size)
    return (grouped == grouped[:, :1]).all(dim=1)


def clipped_surrogate(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, clip_low: float, clip_high: float,
    *, clip_ratio_c: float | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Per-token PPO loss ``max(-A·r, -A·clip(r, 1-low, 1+high))`` and where clipping bit.

    ``advantages`` broadcasts against ``logp`` (one per sequence: shape (B, 1)).

    ``clip_ratio_c`` turns on dual clip (Ye et al., arXiv 1912.09729; verl's option):
    for ``A < 0`` the loss is at most ``-A·c``, so a token whose ratio grew far past
    ``c`` (a stale, off-policy token) cannot dominate the batch. verl always applies
    it with c = 3; here it is off (None) by default so that existing runs keep their
    loss, and must be > 1 when given. The returned mask is True wherever a clip
    (either) made the loss constant in ``logp``: verl logs the two kinds separately.

    Unlike verl, ``logp - old_logp`` is not clamped to ±20 before ``exp``: the two
    agree whenever ``|logp - old_logp| <= 20`` (a ratio of 5e8); past that verl's
    loss stops growing and has no gradient, this one keeps growing (use dual clip).
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"dual-clip clip_ratio_c must be > 1, got {clip_ratio_c}")
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss, bit = torch.maximum(unclipped, clipped), clipped > unclipped
    if clip_ratio_c is not None:
        cap = -advantages * clip_ratio_c
        capped = (advantages < 0) & (loss > cap)
        loss, bit = torch.where(capped, cap, loss), bit | capped
    return loss, bit


def decoupled_surrogate(
    logp: Tensor, proximal_logp: Tensor, behaviour_logp: Tensor, advantages: Tensor,
    clip_low: float, clip_high: float, cap: float, *, clip_ratio_c: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Off-policy correction for stale batches (decoupled PPO).

    Clipping is taken against the proximal policy (the weights before this batch's
    updates), and the behaviour policy that generated the batch enters only through
    an importance weight ``π_prox / π_behav``, capped at ``cap`` so one very stale
    token cannot dominate. On-policy (behaviour == proximal) it is the plain clipped
    surrogate (dual clip included, see :func:`clipped_surrogate`). Returns (per-token
    loss, where clipping bit, the weights).
    """
    weights = torch.exp(proximal_logp - behaviour_logp).clamp(max=cap).detach()
    loss, clipped = clipped_surrogate(
        logp, proximal_logp, advantages, clip_low, clip_high, clip_ratio_c=clip_ratio_c
    )
    return weights * loss, clipped, weights


def aggregate(
    loss: Tensor, mask: Tensor, mode: LossAggregation,
    shared: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:  # fmt: skip
    """Reduce per-token losses (B, T) to a scalar.

    token-mean: every token weighs the same (long answers weigh more);
    seq-mean-token-mean: every sequence weighs the same (GRPO's original);
    seq-mean-token-sum: sums over tokens, then means over sequences (Dr. GRPO style).

    Rows with no tokens count in no denominator, as in current verl: a batch's loss
    must not shrink because some rows were masked out entirely. With no tokens at all
    the result is 0 with a zero gradient (older verl gave NaN for an empty row in
    seq-mean-token-mean). Losses on padding never count, even inf or NaN ones.

    ``shared`` maps the local denominator (tokens or sequences) to the one to divide by:
    under torchrun ``corun.shared_count``, so the ranks' mean gradient is the global mean's.
    """
    if mode not in get_args(LossAggregation):
        raise ValueError(f"unknown loss aggregation {mode!r}")
    keep = mask.bool()
    per_token = torch.where(keep, loss, 0.0)  # not loss · mask: 0 · inf is NaN
    lengths = keep.sum(dim=1)
    shared = shared or (lambda count: count)
    if mode == "token-mean":
        return per_token.sum() / shared(lengths.sum()).clamp(min=1)
    per_sequence = per_token.sum(dim=1)
    if mode == "seq-mean-token-mean":
        per_sequence = per_sequence / lengths.clamp(min=1)
    return per_sequence.sum() / shared((lengths > 0).sum()).clamp(min=1)


def kl_k3(logp: Tensor, ref_logp: Tensor, *, clamp: float | None = None) -> Tensor:
    """Per-token KL(policy || reference) estimate ``exp(d) - d - 1`` with ``d = ref - logp``:
    unbiased and never negative.

    ``clamp`` caps each token's estimate (verl's ``low_var_kl`` caps at 10), so one
    token whose reference probability is far above the policy's cannot blow up the
    loss; capped tokens get no KL gradient. Off (None) by default, as before: an
    uncapped penalty keeps pulling hardest on the tokens that drifted most, and the
    logged KL stays the estimate itself. verl's extra clamp of ``d`` to ±20 changes
    nothing once the value is capped.
    """
    delta = ref_logp - logp
    if clamp is not None:
        if clamp <= 0:
            raise ValueError(f"KL clamp must be positive, got {clamp}")
        # k3(±(c + 1)) >= c, so clamping d there leaves every capped value as it was
        # and keeps exp finite: an inf forward gives a NaN gradient even when capped.
        delta = delta.clamp(-clamp - 1.0, clamp + 1.0)
    # expm1 keeps the small differences of near-on-policy training exact in float32.
    kl = (torch.expm1(delta) - delta).clamp(min=0.0)
    return kl if clamp is None else kl.clamp(max=clamp)


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over (B, T) sequences with any padding.

    ``rewards[b, t]`` is the reward after token ``t``. Masked positions are skipped,
    not ends of a sequence: each real token's TD error bootstraps from the next real
    token's value (0 after the last one), as in verl, whose multi-turn masks hide
    tool output between a turn's tokens. Left and right padding are the special
    cases with no holes. Rewards and values on masked positions are ignored.

    Returns (advantages, returns), both zero on masked positions (verl leaves the
    carried advantage there; no loss reads it). Not whitened: verl whitens inside,
    corun's PPO does it when ``whiten_advantages`` asks.
    """
    keep = mask.bool()
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(next_value)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        # On a masked position both carries pass through unchanged (torch.where, not a
        # product with the mask, so inf or NaN on padding cannot leak in).
        running = torch.where(keep[:, t], delta + gamma * lam * running, running)
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        advantages[:, t] = running
    advantages = torch.where(keep, advantages, 0.0)
    return advantages, torch.where(keep, advantages + values, 0.0)


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float) -> Tensor:
    """Per-token ``0.5 · max((v − R)², (clip(v, v_old ± c) − R)²)`` (verl's
    ``compute_value_loss`` before aggregation; aggregate it with :func:`aggregate`)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
