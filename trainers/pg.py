"""Policy-gradient math shared by every RL trainer (LM GRPO/PPO, diffusion Flow-GRPO).

Pure tensor functions, tested in isolation: group-normalised advantages, the
clipped-ratio surrogate with separate low/high clip (DAPO clip-higher) and optional
dual clip, loss aggregation modes, the k3 KL estimator, GAE, the clipped value
loss, and the rollout corrections for the training–inference mismatch (truncated and
masked importance sampling, rejection, IcePop) with their mismatch diagnostics.
tests/test_pg_reference*.py checks each against an independent reference written
from verl's ``core_algos`` semantics (tests/test_pg_corrections.py: the corrections,
docs/corrections.md: their peers); where these functions differ from it on purpose,
the docstring says so and why.

Shapes: ``B`` sequences (``groups × group_size`` for GRPO), ``T`` response tokens
(or denoising steps); ``mask`` is 1 on tokens that count (any layout: left or right
padding, holes, rows with no tokens).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from corun import ConfigError, world

AdvantageScope = Literal["group", "batch"]
LossAggregation = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]


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
    shared: Callable[[Tensor], Tensor] | None = None, whole: Tensor | None = None,
    horizon: int | None = None,
) -> Tensor:  # fmt: skip
    """Reduce per-token losses (B, T) to a scalar.

    token-mean: every token weighs the same (long answers weigh more);
    seq-mean-token-mean: every sequence weighs the same (GRPO's original);
    seq-mean-token-sum: sums over tokens, then means over sequences with tokens;
    seq-mean-token-sum-norm: the sum over every token divided by a constant, the rows
    times ``horizon`` tokens (default: ``loss``'s width) — Dr. GRPO's normaliser, which
    no row's length or rejection changes.

    Rows with no tokens count in no denominator, as in current verl: a batch's loss
    must not shrink because some rows were masked out entirely. With no tokens at all
    the result is 0 with a zero gradient (older verl gave NaN for an empty row in
    seq-mean-token-mean). Losses on padding never count, even inf or NaN ones.

    ``shared`` maps the local denominator (tokens or sequences) to the one to divide by:
    under torchrun ``corun.shared_count``, so the ranks' mean gradient is the global mean's.

    ``whole``: the mask of the whole mini-batch when ``loss`` covers a chunk of its rows
    (the update's token budget split it): the denominators are then the whole
    mini-batch's, so the chunks' results add up to the unsplit result.
    """
    if mode not in get_args(LossAggregation):
        raise ValueError(f"unknown loss aggregation {mode!r}")
    keep = mask.bool()
    per_token = torch.where(keep, loss, 0.0)  # not loss · mask: 0 · inf is NaN
    lengths = keep.sum(dim=1)
    counted = lengths if whole is None else whole.bool().sum(dim=1)
    shared = shared or (lambda count: count)
    if mode == "token-mean":
        return per_token.sum() / shared(counted.sum()).clamp(min=1)
    if mode == "seq-mean-token-sum-norm":
        rows = torch.tensor(float(keep.shape[0] if whole is None else whole.shape[0]))
        steps = loss.shape[1] if horizon is None else horizon
        return per_token.sum() / (shared(rows.to(per_token.device)) * max(steps, 1)).clamp(min=1)
    per_sequence = per_token.sum(dim=1)
    if mode == "seq-mean-token-mean":
        per_sequence = per_sequence / lengths.clamp(min=1)
    return per_sequence.sum() / shared((counted > 0).sum()).clamp(min=1)


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


# ----------------------------------------------------------------------------- rollout corrections
#
# The engine that sampled a batch (vLLM, another dtype or kernel) computes other
# probabilities than the trainer for the same weights: the training–inference mismatch.
# A correction turns the two log-probs of each sampled token into a weight that
# multiplies the per-token policy loss and a ``keep`` mask of the tokens still in the
# loss. ``trainer_logp``: the trainer's log-prob of each sampled token under the weights
# the batch was sampled with; ``behaviour_logp``: the engine's. ρ = π_train / π_behav.
# docs/corrections.md compares each with the peer it follows.

Correction = Literal["none", "token-tis", "seq-tis", "token-mis", "seq-mis", "geo-rs", "icepop"]

TIS_CAP = 2.0  # verl's rollout_is_threshold, slime's tis_clip
MIS_BAND = (0.5, 2.0)  # verl's seq-MIS preset
GEO_BAND = (0.999, 1.001)  # verl's geo-RS presets
ICEPOP_BAND = (0.5, 5.0)  # IcePop's α, β
# The settings each correction takes; :func:`rollout_correction` refuses the others.
CORRECTION_SETTINGS: dict[Correction, tuple[str, ...]] = {
    "none": (),
    "token-tis": ("cap",),
    "seq-tis": ("cap",),
    "token-mis": ("low", "high"),
    "seq-mis": ("low", "high"),
    "geo-rs": ("low", "high"),
    "icepop": ("low", "high"),
}
# |log ρ| bound of the k1, k3 and sequence mismatch metrics (verl's SAFETY_BOUND): one
# token the engine gave probability 0 must not make the batch's KL estimate infinite.
MISMATCH_CLAMP = 20.0

Shared = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class CorrectionResult:
    """What a correction did to a (B, T) batch.

    ``weights`` (detached, ``trainer_logp``'s dtype) multiply the per-token policy loss:
    1 on padding, 0 on tokens a correction dropped or masked. ``keep`` (bool) is ``mask``
    less the tokens a rejection dropped: pass it to :func:`aggregate` as the mask, so
    they also leave the denominators (as verl's rejection does). ``metrics`` are named
    ``correction/...``: ``weight_mean`` and ``weight_max`` over the kept tokens (1 when
    none is kept), and the shares of counted tokens ``truncated`` (weight capped),
    ``masked`` (weight 0, still counted), ``rejected`` (out of ``keep``), and
    ``rejected_seqs``: the share of rows with tokens that lost all of them.
    """

    weights: Tensor
    keep: Tensor
    metrics: dict[str, float]


def mismatch_log_ratio(trainer_logp: Tensor, behaviour_logp: Tensor, mask: Tensor) -> Tensor:
    """Per-token ``log ρ = trainer_logp - behaviour_logp`` (detached) on counted tokens, 0
    on padding (which may hold anything). Equal log-probs give 0, both -inf included (the
    two agree the token is impossible: ρ = 1, not NaN); one -inf gives ±inf."""
    trainer, behaviour = trainer_logp.detach(), behaviour_logp.detach()
    log_ratio = torch.where(trainer == behaviour, 0.0, trainer - behaviour)
    return torch.where(mask.bool(), log_ratio, 0.0)


def _sequence_log_ratio(log_ratio: Tensor) -> Tensor:
    """Per row ``log ∏ ρ_t = Σ log ρ_t`` over counted tokens (0 for a row without any: ρ =
    1). A row with a +inf and a -inf token (ρ = ∞ · 0, undefined) gets -inf: ρ = 0."""
    total = log_ratio.sum(dim=1)
    return torch.where(total.isnan(), -math.inf, total)


def _log(bound: float) -> float:
    return math.log(bound) if bound > 0 else -math.inf


def _check_cap(cap: float) -> None:
    if not 1.0 <= cap < math.inf:
        raise ValueError(f"importance weight cap must be finite and at least 1, got {cap}")


def _check_band(low: float, high: float) -> None:
    # The band holds ρ = 1, so tokens the two policies agree on always pass; finite, so
    # no weight is infinite.
    if not (0.0 <= low <= 1.0 <= high < math.inf and low < high):
        raise ValueError(f"ratio band must have 0 <= low <= 1 <= high < inf, got [{low}, {high}]")


def _in_band(log_ratio: Tensor, low: float, high: float) -> Tensor:
    return (log_ratio >= _log(low)) & (log_ratio <= _log(high))


def _band_weight(log_ratio: Tensor, low: float, high: float) -> Tensor:
    """ρ where ``log_ratio`` is in the band: exp of the log-ratio clamped to the band
    first, so that no exp overflows outside it (those tokens' weight is replaced)."""
    return torch.exp(log_ratio.clamp(_log(low), _log(high)))


def _result(
    weights: Tensor, keep: Tensor, counted: Tensor, *, truncated: Tensor | None = None,
    masked: Tensor | None = None, shared: Shared | None = None,
) -> CorrectionResult:  # fmt: skip
    """Weights 1 on padding and 0 on dropped tokens, and the correction's metrics."""
    weights = torch.where(keep, weights, (~counted).to(weights.dtype)).detach()
    share = shared or (lambda count: count)
    wide = weights.double()
    none = torch.zeros_like(counted)
    rows = counted.any(dim=1)
    per_token = {
        "truncated": truncated if truncated is not None else none,
        "masked": masked if masked is not None else none,
        "rejected": counted & ~keep,
    }
    tokens = share(counted.sum())
    kept = share(keep.sum())
    metrics = {
        "correction/weight_mean": _share(torch.where(keep, wide, 0.0).sum(), kept, 1.0),
        "correction/weight_max": float(wide[keep].max()) if keep.any() else 1.0,
        **{f"correction/{k}": _share(v.sum(), tokens, 0.0) for k, v in per_token.items()},
        "correction/rejected_seqs": _share((rows & ~keep.any(dim=1)).sum(), share(rows.sum()), 0.0),
    }
    return CorrectionResult(weights, keep, metrics)


def _share(total: Tensor, count: Tensor, empty: float) -> float:
    """``total / count`` (``count``: a shared count, so the ranks' mean is the batch's),
    or ``empty`` when nothing counts anywhere."""
    return float(total) / float(count) if float(count) > 0 else empty


def no_correction(
    trainer_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, *, shared: Shared | None = None
) -> CorrectionResult:
    """``none``: weights exactly 1, ``keep`` = ``mask``; the engine's log-probs are the
    behaviour policy's as they are."""
    counted = mask.bool()
    return _result(torch.ones_like(trainer_logp.detach()), counted, counted, shared=shared)


def token_tis(
    trainer_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, *, cap: float = TIS_CAP,
    shared: Shared | None = None,
) -> CorrectionResult:  # fmt: skip
    """``token-tis``, token-level truncated IS: ``w_t = min(ρ_t, C)``; every token kept.

    Computed as ``exp(min(log ρ_t, log C))``: no overflow. ρ_t = 0 (the trainer gives
    the token probability 0) weighs 0, ρ_t = ∞ (the engine did) weighs C.
    """
    _check_cap(cap)
    counted = mask.bool()
    log_ratio = mismatch_log_ratio(trainer_logp, behaviour_logp, mask)
    weights = torch.exp(log_ratio.clamp(max=math.log(cap)))
    truncated = counted & (log_ratio > math.log(cap))
    return _result(weights, counted, counted, truncated=truncated, shared=shared)


def seq_tis(
    trainer_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, *, cap: float = TIS_CAP,
    shared: Shared | None = None,
) -> CorrectionResult:  # fmt: skip
    """``seq-tis``, sequence-level truncated IS: every token of row i weighs
    ``min(∏_t ρ_t, C)`` over the row's counted tokens; every token kept.

    The product is ``exp(min(Σ_t log ρ_t, log C))``: no overflow however long the row.
    A row without tokens: ρ = 1. See :func:`_sequence_log_ratio` for ∞ · 0.
    """
    _check_cap(cap)
    counted = mask.bool()
    log_ratio = _sequence_log_ratio(mismatch_log_ratio(trainer_logp, behaviour_logp, mask))
    weights = torch.exp(log_ratio.clamp(max=math.log(cap)))[:, None].expand_as(counted)
    truncated = counted & (log_ratio > math.log(cap))[:, None]
    return _result(weights, counted, counted, truncated=truncated, shared=shared)


def token_mis(
    trainer_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, *, low: float = MIS_BAND[0],
    high: float = MIS_BAND[1], shared: Shared | None = None,
) -> CorrectionResult:  # fmt: skip
    """``token-mis``, token-level masked IS: ``w_t = ρ_t`` if ``low <= ρ_t <= high``;
    a token outside the band is rejected (out of ``keep``, weight 0)."""
    _check_band(low, high)
    counted = mask.bool()
    log_ratio = mismatch_log_ratio(trainer_logp, behaviour_logp, mask)
    inside = _in_band(log_ratio, low, high)
    return _result(_band_weight(log_ratio, low, high), counted & inside, counted, shared=shared)


def seq_mis(
    trainer_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, *, low: float = MIS_BAND[0],
    high: float = MIS_BAND[1], shared: Shared | None = None,
) -> CorrectionResult:  # fmt: skip
    """``seq-mis``, sequence-level masked IS: every token of row i weighs ``ρ_i = ∏_t ρ_t``
    if ``low <= ρ_i <= high``; a row outside the band is rejected whole."""
    _check_band(low, high)
    counted = mask.bool()
    log_ratio = _sequence_log_ratio(mismatch_log_ratio(trainer_logp, behaviour_logp, mask))
    weights = _band_weight(log_ratio, low, high)[:, None].expand_as(counted)
    keep = counted & _in_band(log_ratio, low, high)[:, None]
    return _result(weights, keep, counted, shared=shared)


def geo_rs(
    trainer_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, *, low: float = GEO_BAND[0],
    high: float = GEO_BAND[1], shared: Shared | None = None,
) -> CorrectionResult:  # fmt: skip
    """``geo-rs``, geometric-mean rejection: row i is rejected whole unless the geometric
    mean of its ratios ``exp(mean_t log ρ_t)`` is in ``[low, high]``; weights stay 1.

    Length-normalised, so a long answer is not rejected for its length alone as a
    product would be. Compared in log space: no exp at all.
    """
    _check_band(low, high)
    counted = mask.bool()
    log_ratio = _sequence_log_ratio(mismatch_log_ratio(trainer_logp, behaviour_logp, mask))
    mean = log_ratio / counted.sum(dim=1).clamp(min=1)
    keep = counted & _in_band(mean, low, high)[:, None]
    return _result(torch.ones_like(trainer_logp.detach()), keep, counted, shared=shared)


def icepop(
    trainer_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, *, low: float = ICEPOP_BAND[0],
    high: float = ICEPOP_BAND[1], shared: Shared | None = None,
) -> CorrectionResult:  # fmt: skip
    """``icepop``, IcePop's token masking: ``w_t = ρ_t`` if ``low <= ρ_t <= high``, else 0.

    The weights are :func:`token_mis`'s; the difference is the denominator: a masked
    token stays in ``keep``, so it still counts in the loss's token means (IcePop's
    ``1/|y|``), where token-mis drops it from them.
    """
    _check_band(low, high)
    counted = mask.bool()
    log_ratio = mismatch_log_ratio(trainer_logp, behaviour_logp, mask)
    inside = _in_band(log_ratio, low, high)
    weights = torch.where(inside, _band_weight(log_ratio, low, high), 0.0)
    return _result(weights, counted, counted, masked=counted & ~inside, shared=shared)


_CORRECTIONS: dict[str, Callable[..., CorrectionResult]] = {
    "none": no_correction,
    "token-tis": token_tis,
    "seq-tis": seq_tis,
    "token-mis": token_mis,
    "seq-mis": seq_mis,
    "geo-rs": geo_rs,
    "icepop": icepop,
}


def rollout_correction(
    kind: Correction, trainer_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, *,
    cap: float | None = None, low: float | None = None, high: float | None = None,
    shared: Shared | None = None,
) -> CorrectionResult:  # fmt: skip
    """The correction ``kind`` of (B, T) log-probs over ``mask``; a setting left None is
    the correction's default, one it does not take (:data:`CORRECTION_SETTINGS`) is a
    ValueError. ``shared`` as in :func:`aggregate` (``corun.shared_count`` under
    torchrun): the metrics' shares and means are then the whole batch's once averaged
    over the ranks; ``weight_max`` stays each rank's own."""
    if kind not in _CORRECTIONS:
        raise ValueError(f"unknown rollout correction {kind!r}")
    given = {k: v for k, v in (("cap", cap), ("low", low), ("high", high)) if v is not None}
    unused = sorted(set(given) - set(CORRECTION_SETTINGS[kind]))
    if unused:
        raise ValueError(f"rollout correction {kind!r} takes no {', '.join(unused)}")
    return _CORRECTIONS[kind](trainer_logp, behaviour_logp, mask, shared=shared, **given)


def mismatch_metrics(
    trainer_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, *,
    threshold: float = math.log(2.0), shared: Shared | None = None,
) -> dict[str, float]:  # fmt: skip
    """How far the engine's log-probs are from the trainer's for the same tokens, over
    the counted tokens (float64; each 0 when none counts), named ``mismatch/...``:

    ``k1``: mean of ``log π_behav - log π_train``; ``k3``: mean of ``ρ - 1 - log ρ``.
    Both estimate KL(behaviour || trainer) on the behaviour's samples (verl's
    ``rollout_corr/kl`` and ``k3_kl``); k3 is never negative. Each token's log ρ is
    clamped to ±:data:`MISMATCH_CLAMP` first. ``max_abs_log_ratio``: the largest
    |log ρ|, unclamped (inf where one side gave probability 0). ``share_over``: the
    share of tokens with |log ρ| > ``threshold`` (default log 2: a factor of two).
    ``seq_abs_log_ratio``: the mean over rows with tokens of |Σ_t log ρ_t| (clamped
    tokens), the log of the sequence-level ratio. ``shared`` as in :func:`aggregate`.
    """
    if threshold < 0:
        raise ValueError(f"mismatch threshold must be non-negative, got {threshold}")
    counted = mask.bool()
    share = shared or (lambda count: count)
    log_ratio = mismatch_log_ratio(trainer_logp, behaviour_logp, mask).double()
    clamped = log_ratio.clamp(-MISMATCH_CLAMP, MISMATCH_CLAMP)  # padding is 0
    k3 = (torch.expm1(clamped) - clamped).clamp(min=0.0)  # expm1: exact for tiny log ρ
    size = log_ratio.abs()  # padding is 0
    rows = counted.any(dim=1)
    tokens = share(counted.sum())
    return {
        "mismatch/k1": _share(-clamped.sum(), tokens, 0.0),
        "mismatch/k3": _share(k3.sum(), tokens, 0.0),
        "mismatch/max_abs_log_ratio": float(size.max()) if counted.any() else 0.0,
        "mismatch/share_over": _share((counted & (size > threshold)).sum(), tokens, 0.0),
        "mismatch/seq_abs_log_ratio": _share(
            clamped.sum(dim=1).abs()[rows].sum(), share(rows.sum()), 0.0
        ),
    }
