"""Reproducible async runs: ``configs/grpo_async.toml`` under the fixed version schedule.

Two runs with the same seed end bitwise equal although one of them has random delays
injected into its rollouts (so its workers finish in other orders and the trainer
waits at other moments); and a run interrupted at a random step and resumed equals
the straight run. Both on asyncio and trio. The shipped config is used with a small
model and batch (its settings that make it async are kept: 3 batches ahead, 2 worker
threads, staleness ≤ 1, decoupled correction).
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

import corun
from tests.support.fakes import CallLog
from tests.support.loops import step_records
from tests.support.state import assert_state_equal
from trainers.lm.grpo import GRPOTrainer

pytestmark = pytest.mark.anyio

ASYNC = Path(__file__).resolve().parents[1] / "configs/grpo_async.toml"
SMALL = [
    "trainer.init_from=", "trainer.d_model=32", "trainer.n_heads=2", "trainer.n_layers=1",
    "trainer.samples_per_prompt=4", "trainer.eval_size=8", "trainer.truncated_reward=keep",
    "trainer.lr=1e-2", "data.batch_size=4", "loop.eval_interval=0", "loop.baseline_eval=false",
    "log.progress=off", "loop.version_schedule=fixed",
]  # fmt: skip
STEPS = 10


def _config(run_dir: Path, *overrides: str) -> corun.Config:
    return corun.load_config(
        ASYNC, [*SMALL, f"run.dir={run_dir}", f"run.steps={STEPS}", *overrides]
    )


class DelayedGRPO(GRPOTrainer):
    """GRPO whose rollouts first sleep a random 0–40 ms (from an unseeded RNG: timing
    only, nothing that reaches the numbers), and whose calls can be awaited."""

    def __init__(self, config: corun.Config) -> None:
        super().__init__(config)
        self.calls = CallLog()
        self._delays = random.Random()
        self._lock = threading.Lock()

    def rollout(self, examples: list[tuple[str, str]], ctx: corun.RolloutContext) -> corun.Batch:
        with self._lock:
            delay = self._delays.uniform(0.0, 0.04)
        time.sleep(delay)
        return super().rollout(examples, ctx)

    def prepare(self, batch: corun.Batch) -> Any:
        self.calls.append(f"train:{batch.index}")
        return super().prepare(batch)


def _final_state(trainer: GRPOTrainer) -> dict[str, Any]:
    return {"trainer": trainer.state_dict(), "engine": trainer.engine.model.state_dict()}


async def test_two_runs_with_other_timings_are_bitwise_equal(
    tmp_path: Path, anyio_backend: str
) -> None:
    plain = GRPOTrainer(_config(tmp_path / "plain"))
    delayed = DelayedGRPO(_config(tmp_path / "delayed"))
    with anyio.fail_after(120):
        await corun.run(plain, plain.run_config)
        await corun.run(delayed, delayed.run_config)
    assert_state_equal(_final_state(plain), _final_state(delayed))
    records = step_records(tmp_path / "plain")
    assert records == step_records(tmp_path / "delayed")
    # It was async: batches trained on older weights than the trainer's.
    assert max(r["async/staleness_max"] for r in records) == 1


async def test_interrupted_and_resumed_equals_straight(tmp_path: Path, anyio_backend: str) -> None:
    stop_after = random.randint(1, STEPS - 2)  # the step whose train call triggers the stop
    straight = GRPOTrainer(_config(tmp_path / "straight"))
    first = DelayedGRPO(_config(tmp_path / "split"))
    control = corun.RunControl()

    async def stop() -> None:
        await first.calls.reached(f"train:{stop_after}")
        control.stop("interrupted", signal="SIGINT")

    with anyio.fail_after(120):
        await corun.run(straight, straight.run_config)
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop)
            outcome = await corun.run(first, first.run_config, control=control)
        assert outcome.reason == "interrupted", f"stopped after step {stop_after}"
        resumed = DelayedGRPO(_config(tmp_path / "split"))
        await corun.run(resumed, resumed.run_config)
    assert_state_equal(_final_state(straight), _final_state(resumed))
    assert step_records(tmp_path / "split") == step_records(tmp_path / "straight")
