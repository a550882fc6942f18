"""Async-mode engine and trainer behaviours: partial rollouts (interrupt at a weight
publish, per-token versions), completion-order consumption with a real trainer, and
dynamic sampling with several producers (no starvation)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

import corun
from corun.records.events import read_records
from tests.support.config import make_config
from trainers.lm.engine import LocalEngine
from trainers.lm.grpo import GRPOTrainer
from trainers.lm.policy import build_policy, response_logprobs
from trainers.lm.tasks import encode_prompts

TINY = {
    "kind": "grpo", "task": "sort", "d_model": 32, "n_heads": 2, "n_layers": 1,
    "samples_per_prompt": 4, "eval_size": 16, "truncated_reward": "keep",
}  # fmt: skip


def test_interrupted_generation_continues_the_prefix_with_new_weights() -> None:
    """Weights published after two decode steps produce the rest of each response: those
    tokens carry the new version, and every token's behaviour log-prob is the one under
    the weights that produced it (what the off-policy correction relies on)."""
    torch.manual_seed(0)
    old, new = build_policy(32, 1, 2), build_policy(32, 1, 2)
    engine = LocalEngine(old)
    asked = 0

    def newer_weights() -> tuple[int, dict[str, torch.Tensor]]:
        nonlocal asked
        asked += 1
        return (0, old.state_dict()) if asked <= 2 else (1, new.state_dict())

    prompts = encode_prompts(["601976>", "968515>"])
    out = engine.generate(
        prompts, 3, 6, 1.0, generator=torch.Generator().manual_seed(1), newer_weights=newer_weights
    )
    mask = out.response_mask
    assert out.version == 0 and engine.version == 1
    assert (out.token_versions[:, :2] == 0).all() and (
        out.token_versions[:, 2:][mask[:, 2:]] == 1
    ).all()
    old_logp, _, _ = response_logprobs(old, out.sequences, prompts.shape[1], 1.0)
    new_logp, _, _ = response_logprobs(new, out.sequences, prompts.shape[1], 1.0)
    expected = torch.where(out.token_versions == 0, old_logp, new_logp).masked_fill(~mask, 0.0)
    torch.testing.assert_close(out.logprobs, expected)
    assert not torch.allclose(old_logp[:, 2:][mask[:, 2:]], new_logp[:, 2:][mask[:, 2:]])


def test_drain_mode_keeps_one_version_per_generation() -> None:
    torch.manual_seed(0)
    engine = LocalEngine(build_policy(32, 1, 2))
    out = engine.generate(encode_prompts(["601976>"]), 2, 6, 1.0)
    assert (out.token_versions == 0).all() and out.version == 0


@pytest.mark.anyio
@pytest.mark.parametrize("order", ["start", "completion"])
async def test_grpo_interrupt_mode_runs_with_bounded_staleness(tmp_path: Path, order: str) -> None:
    config = make_config(
        tmp_path, TINY | {"inflight_at_sync": "interrupt", "off_policy_correction": "decoupled"},
        run={"steps": 8},
        loop={"concurrency": 3, "workers": 2, "max_staleness": 2, "order": order},
        data={"batch_size": 4},
    )  # fmt: skip
    with anyio.fail_after(120):
        outcome = await corun.run(GRPOTrainer(config), config)
    assert outcome.reason == "done" and outcome.step == 8
    steps = [r for r in read_records(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert len(steps) == 8
    assert all(
        r["async/staleness_max"] <= 2 and 0 <= r["rollout/partial_ratio"] <= 1 for r in steps
    )
    assert all(r["async/dropped"] >= 0 for r in steps)


@pytest.mark.anyio
async def test_dynamic_sampling_with_several_producers_does_not_starve(tmp_path: Path) -> None:
    """Near-greedy sampling makes most groups flat; each rollout still yields one batch
    after at most max_sampling_rounds prompt batches, so producers keep the trainer fed."""
    config = make_config(
        tmp_path, TINY | {"dynamic_sampling": True, "max_sampling_rounds": 3, "temperature": 0.05},
        run={"steps": 6},
        loop={"concurrency": 3, "workers": 2, "order": "completion"},
        data={"batch_size": 4},
    )  # fmt: skip
    with anyio.fail_after(120):
        outcome = await corun.run(GRPOTrainer(config), config)
    assert outcome.reason == "done" and outcome.step == 6
    steps = [r for r in read_records(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert len(steps) == 6
    assert all(1 <= r["rollout/sampling_rounds"] <= 3 for r in steps)
    assert any(r["rollout/zero_std_group_ratio"] > 0 for r in steps)
