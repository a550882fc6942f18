"""Token-budget micro-batches (``loop.micro_batch_tokens``, corun/loop/micro_batches.py):
the plan (rows grouped by length, each chunk within the budget, a long row alone), and
for every loss aggregation and every LM kind, the split update's loss, metrics and
gradients equal the unsplit one's — float64 to 1e-10, float32 within 1e-5 relative."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import msgspec
import pytest
import torch

import corun
from corun.loop.micro_batches import plan_chunks, split_to
from corun.loop.update import Updater
from tests.support.config import make_config
from tests.support.loops import Harness
from trainers.agentic.rl import AgenticGRPOTrainer
from trainers.agentic.sft import AgenticSFTTrainer
from trainers.diffusion.grpo import FlowGRPOTrainer
from trainers.hf.rl import HFGRPOTrainer, HFPPOTrainer
from trainers.hf.sft import HFSFTTrainer
from trainers.lm.distill import Distill, DistillConfig
from trainers.lm.grpo import GRPOTrainer
from trainers.lm.policy_gradient import Scored
from trainers.lm.ppo import PPOTrainer
from trainers.lm.sft import SFTTrainer
from trainers.pg import LossAggregation

MODES: tuple[LossAggregation, ...] = get_args(LossAggregation)
TINY = {"d_model": 32, "n_heads": 2, "n_layers": 1, "eval_size": 8, "lr": 1e-2}
HF = {
    "model": "tiny-llama", "max_new_tokens": 6, "eval_size": 8, "lr": 1e-3,
    "rewards": {"tests.test_hf:letter_share": 1.0},
}  # fmt: skip
# kind: (trainer class, [trainer] settings, prompts per batch)
KINDS: dict[str, tuple[type[Any], dict[str, Any], int]] = {
    "grpo": (GRPOTrainer, {"kind": "grpo", **TINY, "samples_per_prompt": 4}, 4),
    "ppo": (PPOTrainer, {"kind": "ppo", **TINY, "samples_per_prompt": 2}, 4),
    "agentic": (AgenticGRPOTrainer, {"kind": "agentic", **TINY, "samples_per_prompt": 4}, 2),
    "hf_grpo": (HFGRPOTrainer, {"kind": "hf_grpo", **HF, "samples_per_prompt": 4}, 3),
    "hf_ppo": (HFPPOTrainer, {"kind": "hf_ppo", **HF, "samples_per_prompt": 2}, 3),
    # GRPO's trainer with distillation's algorithm: the exact reverse KL to teacher rows
    "hf_distill": (HFGRPOTrainer, {"kind": "hf_grpo", **HF, "samples_per_prompt": 2}, 3),
    # no aggregation modes: token means (SFT), image means (Flow-GRPO)
    "sft": (SFTTrainer, {"kind": "sft", **TINY, "task": "addition"}, 12),
    "agentic_sft": (AgenticSFTTrainer, {"kind": "agentic_sft", **TINY}, 8),
    "hf_sft": (HFSFTTrainer, {"kind": "hf_sft", "model": "tiny-llama", "eval_size": 8}, 8),
    "flow_grpo": (
        FlowGRPOTrainer,
        {
            "kind": "flow_grpo",
            "d_model": 32,
            "n_layers": 1,
            "n_heads": 2,
            "sample_steps": 4,
            "eval_size": 8,
            "grid_size": 4,
            "lr": 1e-3,
            "grpo": {"samples_per_prompt": 4, "timestep_fraction": 0.5},
        },
        2,
    ),
}


# ----------------------------------------------------------------------------- the plan


def test_a_part_that_fits_is_not_split() -> None:
    assert plan_chunks([5, 7, 3], 0, 3, tokens=21) is None  # 3 rows x 7
    assert plan_chunks([5, 7, 3], 0, 3, tokens=0) is None  # 0: never
    assert plan_chunks([5, 7, 3], 0, 3, tokens=0, max_rows=3) is None


def test_rows_are_grouped_by_length_within_the_budget() -> None:
    lengths = [2, 9, 3, 8, 2, 30, 9, 3]
    chunks = plan_chunks(lengths, 0, 8, tokens=20)
    assert chunks is not None
    rows = sorted(int(r) for chunk in chunks for r in chunk)
    assert rows == list(range(8))  # every row once
    for chunk in chunks:
        assert chunk.tolist() == sorted(chunk.tolist())  # batch order within a chunk
        longest = max(lengths[r] for r in chunk.tolist())
        assert len(chunk) * longest <= 20 or len(chunk) == 1
    # The row over the budget goes alone; the two 9s travel together, as do the short ones.
    assert [5] in [c.tolist() for c in chunks]
    assert [1, 6] in [c.tolist() for c in chunks]
    assert [c.tolist() for c in chunks] == [[5], [1, 6], [2, 3], [0, 4, 7]]
    assert plan_chunks(lengths, 2, 5, tokens=20) is not None  # a part's rows only
    assert all(2 <= r < 5 for c in plan_chunks(lengths, 2, 5, tokens=8) or [] for r in c.tolist())


def test_the_row_cap_splits_short_rows_too() -> None:
    chunks = plan_chunks([1] * 7, 0, 7, tokens=1000, max_rows=3)
    assert chunks is not None and [len(c) for c in chunks] == [3, 3, 1]


def test_a_rank_with_fewer_chunks_splits_its_largest() -> None:
    chunks = split_to([torch.tensor([0, 1, 2, 3]), torch.tensor([4])], 4)
    assert [c.tolist() for c in chunks] == [[0], [1], [2, 3], [4]]
    with pytest.raises(RuntimeError, match="peer ranks"):
        split_to([torch.tensor([0])], 2)


# ----------------------------------------------------------------------------- split = unsplit


@pytest.fixture
def float64() -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def _harness(tmp_path: Path, kind: str, **trainer: Any) -> Harness[Any]:
    cls, settings, prompts = KINDS[kind]
    config = make_config(
        tmp_path / kind, {**settings, **trainer}, run={"steps": 2, "seed": 5},
        loop={"baseline_eval": False}, data={"batch_size": prompts},
    )  # fmt: skip
    harness = Harness(cls, config, seed=5)
    if kind == "hf_distill":
        _distill(harness)
    return harness


def _distill(harness: Harness[Any]) -> None:
    """Distillation's algorithm in the trainer's place, its batches with teacher rows."""
    trainer = harness.trainer
    cfg = DistillConfig(kind="hf_distill", samples_per_prompt=2, loss_agg=trainer.config.loss_agg)
    trainer.algorithm = Distill(cfg)
    trainer.algorithm.modules(trainer.policy)
    make = trainer.training_data

    def with_teacher(scored: Scored) -> Any:
        rollouts = scored.rollouts
        shape = (*rollouts.response_ids.shape, trainer.policy.vocab_size)
        rows = torch.randn(shape, generator=torch.Generator().manual_seed(3))
        scored.teacher_rows = torch.log_softmax(rows.to(rollouts.logprobs.dtype), dim=-1)
        return make(scored)

    trainer.training_data = with_teacher


def _in_dtype(harness: Harness[Any], dtype: torch.dtype) -> None:
    trainer = harness.trainer
    for name in ("policy", "model", "reference"):
        module = getattr(trainer, name, None)
        if module is not None:
            module.to(dtype)
    for module in getattr(trainer, "extra_modules", {}).values():
        module.to(dtype)


def _update(
    harness: Harness[Any], batch: corun.Batch, mode: str, tokens: int, rows: int = 0
) -> tuple[dict[str, float], list[torch.Tensor], int]:
    """One window-of-two update's first batch (backward, no step): its metrics, the
    gradients and how many loss calls it took."""
    trainer = harness.trainer
    if mode:  # an LM policy-gradient trainer's aggregation
        trainer.config = msgspec.structs.replace(trainer.config, loss_agg=mode)
        trainer.algorithm.config = msgspec.structs.replace(trainer.algorithm.config, loss_agg=mode)
    calls = []
    loss = trainer.loss

    def counted(batch: corun.Batch, part: corun.Part) -> Any:
        calls.append(part)
        return loss(batch, part)

    trainer.loss = counted
    updater = Updater(
        trainer, harness.ctx.optimizers, window=2, mini_batches=1, seed=5,
        micro_batch_tokens=tokens, micro_batch_rows=rows,
    )  # fmt: skip
    try:
        metrics = updater.train(copy.deepcopy(batch), 0, 0)
    finally:
        del trainer.loss
    params = [p for spec in harness.ctx.optimizers for p in spec.params]
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
    for spec in harness.ctx.optimizers:
        spec.optimizer.zero_grad(set_to_none=True)
    return metrics, grads, len(calls)


def _assert_split_equals_unsplit(
    harness: Harness[Any], batch: corun.Batch, mode: str, rtol: float, atol: float
) -> None:
    lengths = harness.trainer.row_tokens(batch)
    budget = max(lengths) * 2  # two rows of the longest, more of shorter ones
    whole, whole_grads, whole_calls = _update(harness, batch, mode, tokens=0)
    split, split_grads, split_calls = _update(harness, batch, mode, tokens=budget)
    micros = harness.trainer.micro_batches(batch)  # Flow-GRPO: one per trained step
    assert whole_calls == micros and split_calls >= 3 * micros, (micros, split_calls, lengths)
    assert whole.keys() == split.keys()
    for key in (k for k in whole if not k.startswith("perf/")):  # timings differ
        assert split[key] == pytest.approx(whole[key], rel=rtol, abs=atol), key
    assert any(float(g.abs().max()) > 0 for g in whole_grads)
    for a, b in zip(whole_grads, split_grads, strict=True):
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol)


TINY_KINDS = ["grpo", "ppo", "agentic"]
HF_KINDS = ["hf_grpo", "hf_ppo", "hf_distill"]
OTHER_KINDS = ["sft", "agentic_sft", "hf_sft", "flow_grpo"]


@pytest.mark.parametrize("kind", TINY_KINDS + HF_KINDS)
def test_split_update_equals_unsplit_float64(tmp_path: Path, kind: str, float64: None) -> None:
    harness = _harness(tmp_path, kind, truncated_reward="keep")
    _in_dtype(harness, torch.float64)
    batch = harness.rollout(0)
    for mode in MODES:
        _assert_split_equals_unsplit(harness, batch, mode, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", OTHER_KINDS)
def test_split_update_equals_unsplit_other_kinds(tmp_path: Path, kind: str, float64: None) -> None:
    harness = _harness(tmp_path, kind)
    _in_dtype(harness, torch.float64)
    batch = harness.rollout(0)
    _assert_split_equals_unsplit(harness, batch, "", rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["grpo", "hf_grpo"])
def test_split_update_equals_unsplit_float32(tmp_path: Path, kind: str) -> None:
    """float32: the sums over chunks round differently; within 1e-5 relative."""
    harness = _harness(tmp_path, kind, truncated_reward="keep")
    batch = harness.rollout(0)
    for mode in MODES:
        _assert_split_equals_unsplit(harness, batch, mode, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("correction", ["token-mis", "geo-rs", "icepop", "seq-tis"])
def test_a_rejecting_correction_divides_by_the_whole_mini_batch(
    tmp_path: Path, correction: str, float64: None
) -> None:
    """Rejected tokens leave the denominators: decided up front (``prepare`` computes the
    anchor when the batch is split), so the chunks divide as the whole batch does."""
    harness = _harness(tmp_path, "grpo", truncated_reward="keep", rollout_correction=correction)
    _in_dtype(harness, torch.float64)
    batch = harness.rollout(0)
    rollouts = batch.data.rollouts
    noise = torch.randn(rollouts.logprobs.shape, generator=torch.Generator().manual_seed(1))
    every_other_row = (torch.arange(noise.shape[0]) % 2)[:, None]  # the rest: no mismatch
    rollouts.logprobs = (rollouts.logprobs + noise * every_other_row) * rollouts.response_mask
    for mode in MODES:
        _assert_split_equals_unsplit(harness, batch, mode, rtol=1e-10, atol=1e-10)
    metrics, _, _ = _update(harness, batch, "token-mean", tokens=0)
    if correction in ("token-mis", "geo-rs"):
        assert 0 < metrics["train/correction/rejected"] < 1  # the case the test is about


def test_the_row_cap_and_the_token_budget_give_the_same_update(
    tmp_path: Path, float64: None
) -> None:
    harness = _harness(tmp_path, "ppo", truncated_reward="keep")
    _in_dtype(harness, torch.float64)
    batch = harness.rollout(0)
    whole, whole_grads, _ = _update(harness, batch, "token-mean", tokens=0)
    capped, capped_grads, calls = _update(harness, batch, "token-mean", tokens=0, rows=3)
    assert calls == -(-len(harness.trainer.row_tokens(batch)) // 3)
    for key in (k for k in whole if not k.startswith("perf/")):
        assert capped[key] == pytest.approx(whole[key], rel=1e-10, abs=1e-10), key
    for a, b in zip(whole_grads, capped_grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


def test_the_default_budget_keeps_the_recipes_batches_whole(tmp_path: Path) -> None:
    """hf_grpo's recipe batch (16 prompts x 8 samples, 8 new tokens) is one pass: the
    default budget changes nothing for the shipped recipes."""
    harness = _harness(tmp_path, "hf_grpo", samples_per_prompt=8, max_new_tokens=8)
    batch = harness.rollout(0, [harness.data.batch(0)[0]] * 16)
    loop = harness.config.loop
    assert len(harness.trainer.row_tokens(batch)) == 128
    assert max(harness.trainer.row_tokens(batch)) * 128 <= loop.micro_batch_tokens
    _, _, calls = _update(harness, batch, "token-mean", tokens=loop.micro_batch_tokens)
    assert calls == 1
