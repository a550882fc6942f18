"""GRPO with rollouts on worker threads (concurrency > 1): it runs to the end on
asyncio and trio, each worker samples from its own engine replica, and every batch
respects the staleness bound by the version its replica actually used."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from corun.records.events import read_records
from tests.support.config import make_config
from trainers.lm.grpo import GRPOTrainer

pytestmark = pytest.mark.anyio

TINY = {
    "kind": "grpo", "task": "sort", "d_model": 32, "n_heads": 2, "n_layers": 1,
    "samples_per_prompt": 4, "eval_size": 16, "truncated_reward": "keep",
}  # fmt: skip


async def test_grpo_with_rollout_workers(tmp_path: Path) -> None:
    import corun

    config = make_config(
        tmp_path / "run", TINY, run={"steps": 8},
        loop={"concurrency": 3, "workers": 2, "max_staleness": 2, "eval_interval": 8},
        data={"batch_size": 4},
    )  # fmt: skip
    trainer = GRPOTrainer(config)
    with anyio.fail_after(120):
        outcome = await corun.run(trainer, config)
    assert outcome.reason == "done" and outcome.step == 8
    assert len(trainer.replicas) == 2  # one engine replica per rollout worker thread
    steps = [r for r in read_records(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert all(0 <= r["async/staleness_max"] <= 2 for r in steps)
    assert all(1 <= r["async/inflight"] <= 3 for r in steps)
