"""Windowed steps (``loop.accumulate``): several rollout batches accumulate into one
optimizer update. Parity with a hand-written accumulating loop (bitwise), versions and
syncs only at window ends, resume parity, and a save on interrupt in mid-window that
records the window's start (its partial gradients are not state)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import corun
from corun.events import read_jsonl
from tests.conftest import make_config
from tests.fakes import FakeTrainer
from tests.test_resume import assert_state_equal

pytestmark = pytest.mark.anyio

KIND = {"kind": "tests.test_accumulate:WindowTrainer"}


class WindowTrainer(FakeTrainer):
    """The fake's regression, with the update applied at the end of each window."""

    accumulates = True

    def train_step(self, batch: corun.Batch) -> dict[str, float]:
        self.calls.append(f"train:{batch.step}")
        self._phase("train", batch.step + 1)
        x, y = batch.data
        loss = torch.nn.functional.mse_loss(self.model(x), y) / batch.window_size
        loss.backward()
        if batch.ends_window:
            self.optimizer.step()
            self.optimizer.zero_grad()
        return {"train/loss": float(loss.detach())}


def _trainer(
    run_dir: Path, steps: int, trainer: dict[str, Any] = KIND, **loop: Any
) -> WindowTrainer:
    config = make_config(
        run_dir, trainer, run={"steps": steps},
        loop={"accumulate": 3, "save_interval": 3, "baseline_eval": False, **loop},
    )  # fmt: skip
    return WindowTrainer(config)


async def test_windows_equal_a_hand_written_accumulating_loop(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "run", 9)
    with anyio.fail_after(60):
        await corun.run(trainer, trainer.run_config)

    corun.seed_everything(trainer.run_config.run.seed)
    plain = FakeTrainer(trainer.run_config)
    plain.setup(corun.SetupContext(trainer.run_config))
    for index in range(9):
        x, y = plain.rollout(index, index).data
        (torch.nn.functional.mse_loss(plain.model(x), y) / 3).backward()
        if index % 3 == 2:
            plain.optimizer.step()
            plain.optimizer.zero_grad()
    assert_state_equal(trainer.state_dict(), plain.state_dict())

    # Weights change (and are published) only at window ends: versions 1, 2, 3.
    assert [c for c in trainer.calls if c.startswith("sync")] == ["sync:1", "sync:2", "sync:3"]
    assert trainer.calls.index("sync:1") == trainer.calls.index("train:2") + 1
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert [e["version"] for e in events if e["event"] == "step"] == [0, 0, 1, 1, 1, 2, 2, 2, 3]
    saved = [e["step"] for e in events if e["event"] == "checkpoint_written"]
    assert saved == [3, 6, 9]


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
                while "train:4" not in first.calls:
                    await anyio.sleep(0.005)
                control.stop("interrupted", signal="SIGINT")

            tg.start_soon(stop_in_step_5)
            outcome = await corun.run(first, first.run_config, control=control)
        assert outcome.reason == "interrupted" and outcome.step == 4
        saved = [
            e["step"]
            for e in read_jsonl(tmp_path / "split" / "events.jsonl")
            if e["event"] == "checkpoint_written"
        ]
        assert saved == [3]
        resumed = _trainer(tmp_path / "split", 9, slow, save_interval=9)
        await corun.run(resumed, resumed.run_config)
    assert next(c for c in resumed.calls if c.startswith("train")) == "train:3"
    assert_state_equal(straight.state_dict(), resumed.state_dict())
