"""The update protocol: windows (``loop.accumulate``: several rollout batches make one
update), mini-batches (``loop.mini_batches``: optimizer steps per update) and
micro-batches. Parity with the hand-written loop (bitwise), versions and syncs only at
window ends, the version advancing once per update however many optimizer steps it
takes, resume parity, and a save on interrupt in mid-window that records the window's
start (its partial gradients are not state)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import corun
from corun.records.events import read_records
from tests.support.config import make_config
from tests.support.fakes import FakeTrainer
from tests.support.loops import handwritten_loop, step_records
from tests.support.state import assert_state_equal

pytestmark = pytest.mark.anyio

KIND = {"kind": "tests.test_accumulate:CountingTrainer"}


class CountingTrainer(FakeTrainer):
    """The fake's regression, counting optimizer steps and which rows each loss saw."""

    def setup(self, ctx: corun.SetupContext) -> None:
        super().setup(ctx)
        self.optimizer_steps = 0
        self.parts: list[tuple[int, int, int, int, int]] = []  # index, mini, micro, rows
        step = self.optimizer.step

        def counted_step(*args: Any, **kwargs: Any) -> Any:
            self.optimizer_steps += 1
            return step(*args, **kwargs)

        self.optimizer.step = counted_step  # type: ignore[method-assign]

    def loss(self, batch: corun.Batch, part: corun.Part) -> tuple[torch.Tensor, dict[str, float]]:
        rows = part.rows(len(batch.data[0]))
        self.parts.append((batch.index, part.mini, part.micro, rows.start, rows.stop))
        return super().loss(batch, part)


def _trainer(
    run_dir: Path, steps: int, trainer: dict[str, Any] = KIND, **loop: Any
) -> CountingTrainer:
    config = make_config(
        run_dir, trainer, run={"steps": steps},
        loop={"accumulate": 3, "save_interval": 3, "baseline_eval": False, **loop},
    )  # fmt: skip
    return CountingTrainer(config)


async def test_windows_equal_the_handwritten_loop(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "run", 9)
    with anyio.fail_after(60):
        await corun.run(trainer, trainer.run_config)
    plain, records = handwritten_loop(CountingTrainer, trainer.run_config)
    assert_state_equal(trainer.state_dict(), plain.state_dict())
    assert step_records(tmp_path / "run") == records

    # Weights change (and are published) only at window ends: versions 1, 2, 3.
    assert [c for c in trainer.calls if c.startswith("sync")] == ["sync:1", "sync:2", "sync:3"]
    assert trainer.calls.index("sync:1") == trainer.calls.index("train:2") + 1
    events = read_records(tmp_path / "run" / "events.jsonl")
    assert [e["version"] for e in events if e["event"] == "step"] == [0, 0, 1, 1, 1, 2, 2, 2, 3]
    # Snapshots at the window ends; their writes run in the background and may finish
    # in either order (a write can take longer than the three steps to the next save).
    assert [e["step"] for e in events if e["event"] == "save"] == [3, 6, 9]
    assert sorted(e["step"] for e in events if e["event"] == "checkpoint_written") == [3, 6, 9]
    assert trainer.optimizer_steps == 3


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_mini_batches_and_windows_advance_one_version_per_update(
    tmp_path: Path, anyio_backend: str
) -> None:
    """accumulate = 2, mini_batches = 2, micro_batches = 2: each window of two batches
    is one update of two optimizer steps (step j on mini-batch j of both batches, each
    in two micro-batches), and the version advances once per window, as documented."""
    trainer = _trainer(
        tmp_path / "run", 6, {**KIND, "micro_batches": 2}, accumulate=2, mini_batches=2,
        save_interval=2, sync_interval=2,
    )  # fmt: skip
    with anyio.fail_after(60):
        await corun.run(trainer, trainer.run_config)
    plain, records = handwritten_loop(CountingTrainer, trainer.run_config)
    assert_state_equal(trainer.state_dict(), plain.state_dict())
    assert step_records(tmp_path / "run") == records
    assert trainer.optimizer_steps == plain.optimizer_steps == 6  # 3 updates × 2 steps
    events = read_records(tmp_path / "run" / "events.jsonl")
    assert [e["version"] for e in events if e["event"] == "step"] == [0, 1, 1, 2, 2, 3]
    assert [e["version"] for e in events if e["event"] == "sync"] == [1, 2, 3]
    # Window 1 (indexes 0, 1): mini-batch 0 of each as it arrives, then mini-batch 1 of
    # both after the first step; 8 rows → mini-batches of 4 → micro-batches of 2.
    assert trainer.parts[:12] == [
        (0, 0, 0, 0, 2), (0, 0, 1, 2, 4),
        (1, 0, 0, 0, 2), (1, 0, 1, 2, 4),
        (0, 1, 0, 4, 6), (0, 1, 1, 6, 8), (1, 1, 0, 4, 6), (1, 1, 1, 6, 8),
        (2, 0, 0, 0, 2), (2, 0, 1, 2, 4), (3, 0, 0, 0, 2), (3, 0, 1, 2, 4),
    ]  # fmt: skip
    assert len(records) == 6 and all("train/grad_norm" in r for r in records[1::2])


async def test_resume_from_a_window_end_equals_straight(tmp_path: Path) -> None:
    straight = _trainer(tmp_path / "straight", 9)
    with anyio.fail_after(60):
        await corun.run(straight, straight.run_config)
        first = _trainer(tmp_path / "split", 3)
        await corun.run(first, first.run_config)
        resumed = _trainer(tmp_path / "split", 9)
        await corun.run(resumed, resumed.run_config)
    assert_state_equal(straight.state_dict(), resumed.state_dict())


async def test_interrupt_in_mid_window_saves_the_window_start(tmp_path: Path) -> None:
    """Stopped inside step 5 (window 2, second batch) with saves only at the end: the
    save on interrupt writes step 3 (the window's start); the resumed run redoes 4–6."""
    straight = _trainer(tmp_path / "straight", 9, save_interval=9)
    slow = {**KIND, "slow_in": "train", "slow_s": 0.05}
    first = _trainer(tmp_path / "split", 9, slow, save_interval=9)
    control = corun.RunControl()
    with anyio.fail_after(60):
        await corun.run(straight, straight.run_config)
        async with anyio.create_task_group() as tg:

            async def stop_in_step_5() -> None:
                await first.calls.reached("train:4")
                control.stop("interrupted", signal="SIGINT")

            tg.start_soon(stop_in_step_5)
            outcome = await corun.run(first, first.run_config, control=control)
        assert outcome.reason == "interrupted" and outcome.step == 4
        saved = [
            e["step"]
            for e in read_records(tmp_path / "split" / "events.jsonl")
            if e["event"] == "checkpoint_written"
        ]
        assert saved == [3]
        resumed = _trainer(tmp_path / "split", 9, slow, save_interval=9)
        await corun.run(resumed, resumed.run_config)
    assert next(c for c in resumed.calls if c.startswith("train")) == "train:3"
    assert resumed.optimizer_steps == 2  # windows 2 and 3
    assert_state_equal(straight.state_dict(), resumed.state_dict())
