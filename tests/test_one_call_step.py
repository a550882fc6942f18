"""At concurrency 1 in thread compute a step is one lane call: the rollout, then the
update of its batch (corun/loop/fused.py). The loop records what two calls would (the
rollout's time without the update, the trainer's wait without it), a stop between the
halves applies no update, and kept rollouts are recorded before any update.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import corun
from corun.execution import compute
from corun.execution.compute import stop_requested
from corun.records import checkpoint
from corun.records.events import read_records
from tests.support.config import make_config
from tests.support.fakes import CallLog, FakeTrainer
from tests.support.state import assert_state_equal

pytestmark = pytest.mark.anyio

ROLLOUT_S = 0.03
UPDATE_S = 0.3
WAIT_S = 30.0


class Timed(corun.Trainer[corun.TrainerConfig]):
    """Rollouts of ``ROLLOUT_S``, updates of ``UPDATE_S``; each notes the lane call it
    ran in (``rollout_calls``/``update_calls``: the count of lane calls made so far)."""

    def __init__(self, config: corun.Config) -> None:
        super().__init__(config)
        self.calls = CallLog()
        self.rollout_calls: list[int] = []
        self.update_calls: list[int] = []
        self.stop_at = -1  # this index's rollout returns only once the run is stopped

    def rollout(self, inputs: Any, ctx: corun.RolloutContext) -> dict[str, float]:
        self.calls.append(f"rollout:{ctx.index}")
        if ctx.index == self.stop_at:
            until = time.monotonic() + WAIT_S
            while not stop_requested() and time.monotonic() < until:
                time.sleep(0.005)
        time.sleep(ROLLOUT_S)
        self.rollout_calls.append(_lane_calls[0])
        return {}

    def train_step(self, batch: corun.Batch) -> dict[str, float]:
        self.calls.append(f"train:{batch.index}")
        time.sleep(UPDATE_S)
        self.update_calls.append(_lane_calls[0])
        return {"train/seen": float(batch.index)}


_lane_calls = [0]


@pytest.fixture
def counted_lane_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Count every lane call made (``_lane_calls[0]``)."""
    run = compute.Lane.run
    _lane_calls[0] = 0

    async def counted(self: compute.Lane, fn: Any, *args: Any) -> Any:
        _lane_calls[0] += 1
        return await run(self, fn, *args)

    monkeypatch.setattr(compute.Lane, "run", counted)


def _config(run_dir: Path, compute_mode: str = "thread", **sections: Any) -> corun.Config:
    loop = {"compute": compute_mode, "baseline_eval": False, "eval_interval": 0}
    return make_config(run_dir, {"kind": "tests.test_one_call_step:Timed"}, run={"steps": 4},
                       loop=loop, **sections)  # fmt: skip


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_records(run_dir / "metrics.jsonl") if "perf/train_time_s" in r]


@pytest.mark.parametrize("compute_mode", ["thread", "inline"])
async def test_a_step_records_its_rollout_and_update_apart(
    tmp_path: Path, anyio_backend: str, compute_mode: str, counted_lane_calls: None
) -> None:
    trainer = Timed(_config(tmp_path / "run", compute_mode))
    with anyio.fail_after(WAIT_S):
        outcome = await corun.run(trainer, trainer.run_config)
    assert outcome.reason == "done" and outcome.step == 4
    if compute_mode == "thread":  # the rollout and the update of a step: one lane call
        assert trainer.rollout_calls == trainer.update_calls
        assert len(set(trainer.update_calls)) == 4
    steps = _metrics(tmp_path / "run")
    assert [s["train/seen"] for s in steps] == [0.0, 1.0, 2.0, 3.0]
    for step in steps[1:]:  # the first step's idle ratios also span the set-up
        assert ROLLOUT_S <= step["perf/rollout_time_s"] < UPDATE_S  # without the update
        assert step["perf/train_time_s"] >= UPDATE_S
        # The trainer waited for the rollout only; the producer for the update and more.
        assert step["perf/trainer_idle_ratio"] < 0.5 < step["perf/generator_idle_ratio"]
    spans = json.loads((tmp_path / "run" / "trace.json").read_text())
    rollouts, trains = (
        [s for s in spans if s.get("name") == name] for name in ("rollout", "train")
    )
    assert len(rollouts) == len(trains) == 4
    for rollout, train in zip(rollouts, trains, strict=True):  # apart, in order (µs)
        assert rollout["ts"] + rollout["dur"] <= train["ts"] + 1


async def test_a_stop_during_the_rollout_applies_no_update(
    tmp_path: Path, anyio_backend: str
) -> None:
    trainer = Timed(_config(tmp_path / "run"))
    trainer.stop_at = 2
    control = corun.RunControl()

    async def stop() -> None:
        await trainer.calls.reached("rollout:2")
        control.stop("interrupted", signal="SIGINT")

    with anyio.fail_after(WAIT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop)
            outcome = await corun.run(trainer, trainer.run_config, control=control)
    assert outcome.reason == "interrupted" and outcome.step == 2
    assert [c for c in trainer.calls if c.startswith("train:")] == ["train:0", "train:1"]
    assert checkpoint.latest(tmp_path / "run") == checkpoint.step_dir(tmp_path / "run", 2)


class Preparing(FakeTrainer):
    """Its update replaces the batch's data first: a kept batch recorded after an update
    began would be prepared twice after resume."""

    def prepare(self, batch: corun.Batch) -> Any:
        x, y = batch.data
        return (x, y + 1.0)


def _kept_config(run_dir: Path, **trainer: Any) -> corun.Config:
    return make_config(
        run_dir, {"kind": "tests.test_one_call_step:Preparing", **trainer}, run={"steps": 4},
        loop={"baseline_eval": False, "eval_interval": 0},
        checkpoint={"keep_rollouts": True},
    )  # fmt: skip


async def test_a_batch_kept_at_a_stop_mid_update_resumes_bitwise(
    tmp_path: Path, anyio_backend: str
) -> None:
    straight = Preparing(_kept_config(tmp_path / "straight"))
    interrupted = Preparing(_kept_config(tmp_path / "run", slow_in="train", slow_s=0.05))
    control = corun.RunControl()

    async def stop() -> None:
        await interrupted.calls.reached("train:2")
        control.stop("interrupted", signal="SIGINT")

    with anyio.fail_after(WAIT_S):
        await corun.run(straight, straight.run_config)
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop)
            outcome = await corun.run(interrupted, interrupted.run_config, control=control)
        assert outcome.reason == "interrupted" and outcome.step == 2  # cut at a cancel point
        resumed = Preparing(_kept_config(tmp_path / "run"))
        await corun.run(resumed, resumed.run_config)
    assert "rollout:2" not in resumed.calls  # kept: trained without a rollout
    assert_state_equal(_weights(tmp_path / "run"), _weights(tmp_path / "straight"))


def _weights(run_dir: Path) -> Any:
    state = torch.load(checkpoint.step_dir(run_dir, 4) / "trainer.pt", weights_only=True)
    return state["trainer"]["model"]
