"""trainers/pg.py's rollout corrections and mismatch metrics against references written
independently from their published definitions (docs/corrections.md).

Each reference is plain Python, one row and one token at a time, and works in ratio
space (ρ = math.exp(log π_train − log π_behav), a sequence's ρ as the product of its
tokens', compared with the band as a ratio) where the code works in log space (sums of
log-ratios compared with log-bounds); it never calls trainers/pg.py. Each test runs
NUM_CASES seeded random cases per dtype: ragged masks (left/right padding, holes, empty
rows), garbage on padding, log-ratios from 1e-4 to ±50, probabilities of exactly 0 on
either side or both, float32 and float64. The reference reads the inputs after rounding
to the dtype, so only the code's own rounding counts; a decision within that rounding
of a bound (a near-tie) may go either way and is not compared.

``python -m tests.test_pg_corrections`` prints the worst relative difference seen.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from tests.test_pg_reference import random_mask
from trainers.pg import (
    Correction,
    CorrectionResult,
    aggregate,
    mismatch_metrics,
    rollout_correction,
)

F32, F64 = torch.float32, torch.float64
DTYPES = [pytest.param(F32, id="float32"), pytest.param(F64, id="float64")]
NUM_CASES = 300
# Relative tolerance per dtype, times (1 + the sum of |log ρ| the value was made of).
TOL = {F32: 1e-5, F64: 1e-13}
KINDS: list[Correction] = [
    "none", "token-tis", "seq-tis", "token-mis", "seq-mis", "geo-rs", "icepop",
]  # fmt: skip
# The documented defaults (docs/corrections.md), pinned here on purpose.
DEFAULTS: dict[str, dict[str, float]] = {
    "none": {},
    "token-tis": {"cap": 2.0},
    "seq-tis": {"cap": 2.0},
    "token-mis": {"low": 0.5, "high": 2.0},
    "seq-mis": {"low": 0.5, "high": 2.0},
    "geo-rs": {"low": 0.999, "high": 1.001},
    "icepop": {"low": 0.5, "high": 5.0},
}
WORST: dict[str, float] = {}
INF = math.inf
Rows = list[list[float]]


# ----------------------------------------------------------------------------- cases


def random_pair(rng: random.Random, profile: str) -> tuple[float, float]:
    """(trainer, behaviour) log-probs of one counted token. ``profile`` sets how far apart
    they mostly are, so that whole rows land inside narrow bands too; then and again an
    extreme: log-ratios of ±50, or probability 0 on one side or both."""
    behaviour = rng.uniform(-10, 0)
    odd = rng.random()
    if odd < 0.03:
        return -INF, behaviour  # the trainer gives the sampled token probability 0
    if odd < 0.05:
        return behaviour, -INF  # the engine did
    if odd < 0.06:
        return -INF, -INF
    if odd < 0.09:
        return behaviour + rng.choice([-50.0, 50.0]), behaviour
    if odd < 0.15:
        return behaviour, behaviour
    spread = {"near": 1e-4, "small": 0.05, "medium": 0.7, "large": 3.0}[profile]
    return behaviour + rng.uniform(-spread, spread), behaviour


def random_case(rng: random.Random, dtype: torch.dtype) -> tuple[Tensor, Tensor, list[list[bool]]]:
    rows, cols = rng.randint(1, 8), rng.randint(1, 12)
    profile = rng.choice(["near", "near", "small", "medium", "large"])
    mask = random_mask(rng, rows, cols)
    garbage = [math.nan, INF, -INF, 1e6, -3.0]
    pairs = [[random_pair(rng, profile) if m else (rng.choice(garbage), rng.choice(garbage))
              for m in row] for row in mask]  # fmt: skip
    trainer = torch.tensor([[p[0] for p in row] for row in pairs], dtype=dtype)
    behaviour = torch.tensor([[p[1] for p in row] for row in pairs], dtype=dtype)
    return trainer, behaviour, mask


def random_settings(rng: random.Random, kind: str) -> dict[str, float]:
    """Explicit settings (some at their bounds: cap 1, low 0), or none: the defaults."""
    if rng.random() < 0.4 or kind == "none":
        return {}
    if kind.endswith("tis"):
        return {"cap": rng.choice([1.0, 1.5, rng.uniform(1.0, 10.0)])}
    if kind == "geo-rs":
        width = rng.choice([1e-3, 1e-2, 0.1])
        return {"low": 1 - width, "high": 1 + width}
    return {"low": rng.choice([0.0, 0.2, rng.uniform(0.0, 1.0)]), "high": rng.uniform(1.0, 10.0)}


# ----------------------------------------------------------------------------- references


def ref_ratio(trainer: float, behaviour: float) -> float:
    """ρ = π_train / π_behav of one token; equal log-probs (both -inf too) are ρ = 1."""
    if trainer == behaviour:
        return 1.0
    d = trainer - behaviour
    return INF if d > 709 else math.exp(d)


def ref_log(x: float) -> float:
    return -INF if x == 0 else INF if x == INF else math.log(x)


class Reference:
    """One case's expected weights, keep, flags, and where a decision is a near-tie."""

    def __init__(self, rows: int, cols: int) -> None:
        self.weights = [[1.0] * cols for _ in range(rows)]
        self.keep = [[False] * cols for _ in range(rows)]
        self.truncated = [[False] * cols for _ in range(rows)]
        self.masked = [[False] * cols for _ in range(rows)]
        self.tie = [[False] * cols for _ in range(rows)]
        self.scale = [[0.0] * cols for _ in range(rows)]  # Σ finite |log ρ| behind a value

    def set(self, i: int, j: int, weight: float, keep: bool, scale: float, tie: bool,
            truncated: bool = False, masked: bool = False) -> None:  # fmt: skip
        self.weights[i][j] = weight
        self.keep[i][j], self.truncated[i][j], self.masked[i][j] = keep, truncated, masked
        self.scale[i][j], self.tie[i][j] = scale, tie


def near(log_value: float, bounds: list[float], scale: float, dtype: torch.dtype) -> bool:
    """Whether ``log_value`` is within the code's rounding of a bound (in log space), but
    not on it: ρ = 1 exactly (equal log-probs) against a bound of 1 is exact both ways."""
    return any(
        0 < abs(log_value - ref_log(b)) <= 10 * TOL[dtype] * (abs(ref_log(b)) + scale)
        for b in bounds
        if 0 < b < INF
    )


def ref_correction(kind: str, trainer: Rows, behaviour: Rows, mask: list[list[bool]],
                   settings: dict[str, float], dtype: torch.dtype) -> Reference:  # fmt: skip
    """The published definitions (docs/corrections.md), token by token, row by row."""
    s = {**DEFAULTS[kind], **settings}
    ref = Reference(len(mask), len(mask[0]))
    for i, row in enumerate(mask):
        counted = [j for j, m in enumerate(row) if m]
        ratios = {j: ref_ratio(trainer[i][j], behaviour[i][j]) for j in counted}
        sizes = {j: abs(ref_log(r)) if 0 < r < INF else 0.0 for j, r in ratios.items()}
        product = math.prod(ratios.values())  # the sequence's ρ; empty: 1
        seq_ratio = 0.0 if math.isnan(product) else product  # ∞ · 0 is documented as 0
        row_scale = sum(sizes.values())
        for j in counted:
            rho, size = ratios[j], sizes[j]
            if kind == "none":
                ref.set(i, j, 1.0, True, 0.0, False)
            elif kind == "token-tis":
                tie = near(ref_log(rho), [s["cap"]], size, dtype)
                ref.set(i, j, min(rho, s["cap"]), True, size, tie, truncated=rho > s["cap"])
            elif kind == "seq-tis":
                tie = near(ref_log(seq_ratio), [s["cap"]], row_scale, dtype)
                ref.set(i, j, min(seq_ratio, s["cap"]), True, row_scale, tie,
                        truncated=seq_ratio > s["cap"])  # fmt: skip
            elif kind in ("token-mis", "icepop"):
                inside = s["low"] <= rho <= s["high"]
                tie = near(ref_log(rho), [s["low"], s["high"]], size, dtype)
                if kind == "icepop":  # masked tokens stay counted, with weight 0
                    ref.set(i, j, rho if inside else 0.0, True, size, tie, masked=not inside)
                else:
                    ref.set(i, j, rho if inside else 0.0, inside, size, tie)
            elif kind == "seq-mis":
                inside = s["low"] <= seq_ratio <= s["high"]
                tie = near(ref_log(seq_ratio), [s["low"], s["high"]], row_scale, dtype)
                ref.set(i, j, seq_ratio if inside else 0.0, inside, row_scale, tie)
            else:  # geo-rs: the geometric mean of the row's ratios
                geo = seq_ratio ** (1 / len(counted))
                inside = s["low"] <= geo <= s["high"]
                tie = near(ref_log(geo), [s["low"], s["high"]], row_scale / len(counted), dtype)
                ref.set(i, j, 1.0 if inside else 0.0, inside, row_scale, tie)
    return ref


def ref_correction_metrics(ref: Reference, mask: list[list[bool]]) -> dict[str, float]:
    counted = [(i, j) for i, row in enumerate(mask) for j, m in enumerate(row) if m]
    kept = [ref.weights[i][j] for i, j in counted if ref.keep[i][j]]
    rows = [i for i, row in enumerate(mask) if any(row)]
    lost = [i for i in rows if not any(k and m for k, m in zip(ref.keep[i], mask[i], strict=True))]

    def share(flags: list[list[bool]]) -> float:
        return sum(flags[i][j] for i, j in counted) / len(counted) if counted else 0.0

    return {
        "correction/weight_mean": math.fsum(kept) / len(kept) if kept else 1.0,
        "correction/weight_max": max(kept) if kept else 1.0,
        "correction/truncated": share(ref.truncated),
        "correction/masked": share(ref.masked),
        "correction/rejected": share([[not k for k in row] for row in ref.keep]),
        "correction/rejected_seqs": len(lost) / len(rows) if rows else 0.0,
    }


def ref_k3(c: float) -> float:
    """ρ − 1 − log ρ with log ρ = c; small c by its Taylor series (no cancellation)."""
    if abs(c) < 1e-2:
        return sum(c**k / math.factorial(k) for k in range(2, 8))
    return math.exp(c) - 1 - c


def ref_mismatch(trainer: Rows, behaviour: Rows, mask: list[list[bool]],
                 threshold: float) -> dict[str, float]:  # fmt: skip
    """k1, k3 of KL(behaviour || trainer) with log ρ clamped to ±20, and the rest."""
    logs = [[0.0 if trainer[i][j] == behaviour[i][j] else trainer[i][j] - behaviour[i][j]
             for j, m in enumerate(row) if m] for i, row in enumerate(mask)]  # fmt: skip
    flat = [d for row in logs for d in row]
    clamped = [max(-20.0, min(20.0, d)) for d in flat]
    seqs = [abs(math.fsum(max(-20.0, min(20.0, d)) for d in row)) for row in logs if row]
    if not flat:
        return dict.fromkeys(MISMATCH_KEYS, 0.0)
    return {
        "mismatch/k1": math.fsum(-c for c in clamped) / len(flat),
        "mismatch/k3": math.fsum(ref_k3(c) for c in clamped) / len(flat),
        "mismatch/max_abs_log_ratio": max(abs(d) for d in flat),
        "mismatch/share_over": sum(abs(d) > threshold for d in flat) / len(flat),
        "mismatch/seq_abs_log_ratio": math.fsum(seqs) / len(seqs),
    }


MISMATCH_KEYS = ["mismatch/k1", "mismatch/k3", "mismatch/max_abs_log_ratio",
                 "mismatch/share_over", "mismatch/seq_abs_log_ratio"]  # fmt: skip


# ----------------------------------------------------------------------------- checks


def note(key: str, got: float, want: float) -> None:
    if math.isfinite(want):
        WORST[key] = max(WORST.get(key, 0.0), abs(got - want) / (1 + abs(want)))


def check_case(kind: str, got: CorrectionResult, ref: Reference, mask: list[list[bool]],
               dtype: torch.dtype, seed: int) -> bool:  # fmt: skip
    """Weights and keep where decided; metrics when nothing is a near-tie. Returns
    whether the case had a near-tie."""
    where = f"{kind} {dtype}, seed {seed}"
    assert got.weights.dtype == dtype and got.keep.dtype == torch.bool, where
    assert not got.weights.requires_grad and torch.isfinite(got.weights).all(), where
    weights, keep = got.weights.to(F64).tolist(), got.keep.tolist()
    for i, row in enumerate(mask):
        for j, m in enumerate(row):
            if ref.tie[i][j]:
                continue
            want, have = ref.weights[i][j], weights[i][j]
            note(f"{kind} weights {dtype}", have, want)
            allowed = TOL[dtype] * (1 + ref.scale[i][j]) * (1 + abs(want))
            assert abs(have - want) <= allowed, (where, i, j, have, want)
            assert keep[i][j] == (ref.keep[i][j] and m), (where, i, j)
    tied = any(t for row in ref.tie for t in row)
    if not tied:
        scale = 1 + max((s for row in ref.scale for s in row), default=0.0)
        for key, want in ref_correction_metrics(ref, mask).items():
            have = got.metrics[key]
            note(f"{key} {dtype}", have, want)
            allowed = TOL[dtype] * scale * (1 + abs(want))
            assert abs(have - want) <= allowed, (where, key, have, want)
    return tied


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_correction_matches_reference(kind: Correction, dtype: torch.dtype) -> None:
    ties, outcomes = 0, Counter[str]()
    for seed in range(NUM_CASES):
        rng = random.Random(seed)
        trainer, behaviour, mask = random_case(rng, dtype)
        settings = random_settings(rng, kind)
        got = rollout_correction(
            kind, trainer, behaviour, torch.tensor(mask), cap=settings.get("cap"),
            low=settings.get("low"), high=settings.get("high"),
        )  # fmt: skip
        ref = ref_correction(kind, trainer.tolist(), behaviour.tolist(), mask, settings, dtype)
        ties += check_case(kind, got, ref, mask, dtype, seed)
        flags = ref_correction_metrics(ref, mask)
        outcomes.update(k for k, v in flags.items() if v > 0 and not k.startswith("correction/w"))
        outcomes["kept"] += any(k for row in ref.keep for k in row)
    assert ties < NUM_CASES // 20, ties  # near-ties are rare: the checks did run
    # Each correction's decisions did go both ways in the generated cases.
    expected = {"token-tis": ["truncated"], "seq-tis": ["truncated"], "icepop": ["masked"],
                "token-mis": ["rejected", "rejected_seqs"], "seq-mis": ["rejected_seqs"],
                "geo-rs": ["rejected_seqs"]}.get(kind, [])  # fmt: skip
    for name in expected:
        assert outcomes[f"correction/{name}"] > 20, (kind, outcomes)
    assert outcomes["kept"] > 100, (kind, outcomes)


def test_none_is_the_identity() -> None:
    """``none``: weights exactly 1 (padding too), keep == mask, whatever the log-probs."""
    for seed in range(50):
        rng = random.Random(seed)
        trainer, behaviour, mask = random_case(rng, rng.choice([F32, F64]))
        got = rollout_correction("none", trainer, behaviour, torch.tensor(mask))
        assert torch.equal(got.weights, torch.ones_like(trainer)), seed
        assert torch.equal(got.keep, torch.tensor(mask)), seed


@pytest.mark.parametrize("kind", KINDS)
def test_on_policy_every_correction_changes_nothing(kind: Correction) -> None:
    """Trainer and engine agree (equal log-probs, probability 0 included): weights 1,
    keep == mask, nothing truncated, masked or rejected; mismatch metrics all 0."""
    for seed in range(30):
        rng = random.Random(seed)
        _, behaviour, mask = random_case(rng, F32)
        got = rollout_correction(kind, behaviour.clone(), behaviour, torch.tensor(mask))
        counted = torch.tensor(mask)
        assert torch.equal(got.weights[counted], torch.ones(int(counted.sum()))), (kind, seed)
        assert torch.equal(got.keep, counted), (kind, seed)
        assert got.metrics["correction/rejected"] == got.metrics["correction/masked"] == 0.0
        assert got.metrics["correction/truncated"] == 0.0
        stats = mismatch_metrics(behaviour.clone(), behaviour, counted)
        assert all(v == 0.0 for v in stats.values()), (seed, stats)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mismatch_metrics_match_reference(dtype: torch.dtype) -> None:
    for seed in range(NUM_CASES):
        rng = random.Random(seed)
        trainer, behaviour, mask = random_case(rng, dtype)
        threshold = rng.choice([math.log(2.0), 0.0, rng.uniform(0.0, 3.0)])
        got = mismatch_metrics(trainer, behaviour, torch.tensor(mask), threshold=threshold)
        t, b = trainer.tolist(), behaviour.tolist()
        want = ref_mismatch(t, b, mask, threshold)
        # Scale: the clamped log-ratios and their exponentials, whose rounding counts.
        logs = [min(20.0, abs(x - y)) for tr, br, mr in zip(t, b, mask, strict=True)
                for x, y, m in zip(tr, br, mr, strict=True) if m and x != y]  # fmt: skip
        scale = 1 + sum(v + math.expm1(v) for v in logs)
        near_threshold = any(abs(v - threshold) <= 10 * TOL[dtype] * (1 + v) for v in logs)
        for key in MISMATCH_KEYS:
            if key == "mismatch/share_over" and near_threshold:
                continue
            have, expected = got[key], want[key]
            note(f"{key} {dtype}", have, expected)
            assert have == expected or abs(have - expected) <= TOL[dtype] * scale, (
                seed, key, have, expected,
            )  # fmt: skip


# ----------------------------------------------------------------------------- semantics


def test_extremes_by_hand() -> None:
    """The documented edge cases: probability 0 on one side or both, an undefined
    sequence ratio (∞ · 0) counts as 0, empty rows weigh 1 and are not rejected."""
    t = torch.tensor([[-INF, -1.0, 0.0], [-INF, -1.0, 0.0], [0.0, 0.0, 0.0]])
    b = torch.tensor([[-1.0, -INF, 0.0], [-INF, -1.0, math.nan], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False], [False, False, False]])
    tis = rollout_correction("token-tis", t, b, mask)
    assert tis.weights.tolist() == [[0.0, 2.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    seq = rollout_correction("seq-tis", t, b, mask)  # row 0: ρ = 0 · ∞ → 0
    assert seq.weights.tolist() == [[0.0, 0.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    mis = rollout_correction("seq-mis", t, b, mask)
    assert mis.keep.tolist() == [[False] * 3, [True, True, False], [False] * 3]
    assert mis.metrics["correction/rejected_seqs"] == 0.5  # of the two rows with tokens
    stats = mismatch_metrics(t, b, mask)
    assert stats["mismatch/max_abs_log_ratio"] == INF and math.isfinite(stats["mismatch/k3"])
    # The band is closed: ratios of exactly 0.5 and 2 pass (float64: log 2 is exact here).
    edge = torch.tensor([[-math.log(2.0), math.log(2.0), 0.7]], dtype=F64)
    band = rollout_correction("token-mis", edge, torch.zeros_like(edge), torch.ones(1, 3).bool())
    assert band.keep.tolist() == [[True, True, False]] and band.weights[0, 1] == 2.0


def test_icepop_and_token_mis_differ_only_in_the_denominator() -> None:
    """Same weights; IcePop keeps a masked token in the token mean (weight 0), token-mis
    drops it, so the aggregated losses differ by the count."""
    t = torch.tensor([[0.0, -0.1, -3.0, -0.2]])
    b = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    ice = rollout_correction("icepop", t, b, mask, low=0.5, high=5.0)
    mis = rollout_correction("token-mis", t, b, mask, low=0.5, high=5.0)
    assert torch.equal(ice.weights, mis.weights) and ice.weights[0, 2] == 0.0
    loss = torch.ones(1, 4)
    assert float(aggregate(ice.weights * loss, ice.keep, "token-mean")) == pytest.approx(
        (1 + math.exp(-0.1) + math.exp(-0.2)) / 4
    )
    assert float(aggregate(mis.weights * loss, mis.keep, "token-mean")) == pytest.approx(
        (1 + math.exp(-0.1) + math.exp(-0.2)) / 3
    )
    assert ice.metrics["correction/masked"] == mis.metrics["correction/rejected"] == 0.25


def two_ranks(fn: Callable[..., dict[str, float]],
              halves: list[tuple[Tensor, Tensor, Tensor]]) -> list[dict[str, float]]:  # fmt: skip
    """``fn`` on each half as two data-parallel ranks would run it: ``shared`` returns
    the two ranks' count summed over the world size (corun.shared_count's contract)."""
    calls: list[list[Tensor]] = [[], []]

    def record(rank: int) -> Callable[[Tensor], Tensor]:
        def shared(count: Tensor) -> Tensor:
            calls[rank].append(count)
            return count

        return shared

    for rank, half in enumerate(halves):
        fn(*half, shared=record(rank))
    totals = [(a + b) / 2 for a, b in zip(*calls, strict=True)]
    results = []
    for half in halves:
        answers = iter(totals)  # the same calls in the same order on each rank
        results.append(fn(*half, shared=lambda _count, it=answers: next(it)))
    return results


@pytest.mark.parametrize("kind", ["token-mis", "seq-tis", "icepop", "geo-rs"])
def test_shared_counts_give_the_whole_batchs_means(kind: Correction) -> None:
    """Averaged over two ranks (as the runtime does), each rank's shares and means are
    the whole batch's; so are the mismatch metrics' (the max is a rank's own)."""
    for seed in range(20):
        rng = random.Random(seed)
        trainer, behaviour, mask = random_case(rng, F64)
        if len(mask) < 2:
            continue
        m = torch.tensor(mask)
        cut = len(mask) // 2
        halves = [
            (trainer[:cut], behaviour[:cut], m[:cut]),
            (trainer[cut:], behaviour[cut:], m[cut:]),
        ]
        whole = rollout_correction(kind, trainer, behaviour, m)
        ranks = two_ranks(lambda *a, **k: rollout_correction(kind, *a, **k).metrics, halves)
        both_kept = all(bool(h[2].any()) for h in halves) and bool(whole.keep.any())
        for key, value in whole.metrics.items():
            if key == "correction/weight_max" or (
                key == "correction/weight_mean" and not both_kept
            ):
                continue  # a rank without kept tokens reports the neutral 1
            assert (ranks[0][key] + ranks[1][key]) / 2 == pytest.approx(value, abs=1e-12), key
        whole_mismatch = mismatch_metrics(trainer, behaviour, m)
        split = two_ranks(lambda *a, **k: mismatch_metrics(*a, **k), halves)
        for key in set(MISMATCH_KEYS) - {"mismatch/max_abs_log_ratio"}:
            mean = (split[0][key] + split[1][key]) / 2
            assert mean == pytest.approx(whole_mismatch[key], rel=1e-9, abs=1e-12), key


def test_settings_are_checked() -> None:
    t = b = torch.zeros(1, 2)
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="unknown rollout correction 'tis'"):
        rollout_correction("tis", t, b, mask)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'icepop' takes no cap"):
        rollout_correction("icepop", t, b, mask, cap=2.0)
    with pytest.raises(ValueError, match="'none' takes no high, low"):
        rollout_correction("none", t, b, mask, low=0.5, high=2.0)
    with pytest.raises(ValueError, match="cap must be finite and at least 1"):
        rollout_correction("seq-tis", t, b, mask, cap=0.5)
    for low, high in [(0.5, 0.9), (1.1, 2.0), (-0.1, 2.0), (0.5, INF), (1.0, 1.0)]:
        with pytest.raises(ValueError, match="ratio band must have"):
            rollout_correction("token-mis", t, b, mask, low=low, high=high)
    with pytest.raises(ValueError, match="threshold must be non-negative"):
        mismatch_metrics(t, b, mask, threshold=-1.0)


if __name__ == "__main__":
    for dtype in (F32, F64):
        for kind in KINDS:
            test_correction_matches_reference(kind, dtype)
        test_mismatch_metrics_match_reference(dtype)
    for key, worst in sorted(WORST.items()):
        print(f"{key:50s} {worst:.1e}")
