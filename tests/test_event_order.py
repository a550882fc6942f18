"""Golden event-order tests: the same lifecycle on a clean exit, on an error in each
training hook, and on cancellation mid-step, on asyncio and trio.

Like Lightning's test_hooks: record every hook call of a short run and assert the
exact sequence, plus the lifecycle events written to events.jsonl.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

import corun
from corun.records import checkpoint
from corun.records.events import read_records
from tests.support.config import make_config
from tests.support.fakes import TEARDOWN_ORDER, FakeError, FakeTrainer

pytestmark = pytest.mark.anyio

TEARDOWN = [*TEARDOWN_ORDER, "end"]
LOOP = {"eval_interval": 2, "save_interval": 2}


def _config(tmp_path: Path, **trainer: Any) -> corun.Config:
    return make_config(
        tmp_path / "run",
        {"kind": "tests.support.fakes:FakeTrainer", **trainer},
        run={"steps": 3},
        loop=LOOP,
    )


def _events(tmp_path: Path) -> list[str]:
    """Event names, without the background write completions (their timing varies)."""
    records = read_records(tmp_path / "run" / "events.jsonl")
    return [r["event"] for r in records if r["event"] != "checkpoint_written"]


def _end(tmp_path: Path) -> dict[str, Any]:
    return read_records(tmp_path / "run" / "events.jsonl")[-1]


async def test_clean_exit(tmp_path: Path) -> None:
    trainer = FakeTrainer(_config(tmp_path))
    with anyio.fail_after(30):
        outcome = await corun.run(trainer, trainer.run_config)
    assert outcome.reason == "done" and outcome.step == 3
    assert trainer.calls == [
        "setup", "eval",
        "rollout:0", "train:0", "sync:1",
        "rollout:1", "train:1", "sync:2", "eval",
        "rollout:2", "train:2", "sync:3", "eval",
        "teardown:weight_sync", "teardown:engine", "on_train_end:done",
    ]  # fmt: skip
    assert _events(tmp_path) == [
        "start", "setup", "baseline_eval",
        "step", "sync",
        "step", "sync", "eval", "save",
        "step", "sync", "eval", "save",
        *TEARDOWN,
    ]  # fmt: skip
    assert _end(tmp_path)["reason"] == "done"
    assert [step for step, _ in checkpoint.list_checkpoints(tmp_path / "run")] == [2, 3]


@pytest.mark.parametrize(
    ("phase", "calls_before_teardown"),
    [
        ("train", ["setup", "eval", "rollout:0", "train:0", "sync:1", "rollout:1", "train:1"]),
        ("rollout", ["setup", "eval", "rollout:0", "train:0", "sync:1", "rollout:1"]),
        ("eval", ["setup", "eval", "rollout:0", "train:0", "sync:1", "rollout:1", "train:1",
                  "sync:2", "eval"]),
    ],
)  # fmt: skip
async def test_error_in_hook(tmp_path: Path, phase: str, calls_before_teardown: list[str]) -> None:
    trainer = FakeTrainer(_config(tmp_path, fail_in=phase, fail_at_step=2))
    with anyio.fail_after(30), pytest.raises(FakeError, match=f"failure in {phase}"):
        await corun.run(trainer, trainer.run_config)
    assert trainer.calls == [
        *calls_before_teardown,
        "teardown:weight_sync",
        "teardown:engine",
        "on_train_end:error",
    ]
    events = _events(tmp_path)
    assert events[-len(TEARDOWN) :] == TEARDOWN
    assert _end(tmp_path)["reason"] == "error"
    assert "FakeError" in _end(tmp_path)["error"]


async def test_first_error_propagates_and_teardown_continues(tmp_path: Path) -> None:
    trainer = FakeTrainer(_config(tmp_path, fail_in="train", fail_at_step=1, teardown_fails=True))
    with anyio.fail_after(30), pytest.raises(FakeError, match="failure in train"):
        await corun.run(trainer, trainer.run_config)
    # The failing weight-sync teardown did not stop the later steps.
    assert trainer.calls[-3:] == ["teardown:weight_sync", "teardown:engine", "on_train_end:error"]
    records = read_records(tmp_path / "run" / "events.jsonl")
    statuses = {r["event"]: r.get("status") for r in records}
    assert statuses["teardown:weight_sync"] == "error"
    assert statuses["teardown:engine"] == "ok"


async def _stop_when(trainer: FakeTrainer, call: str, control: corun.RunControl) -> None:
    await trainer.calls.reached(call)
    control.stop("interrupted", signal="SIGINT")


async def test_interrupt_mid_step_saves_last_complete_step(tmp_path: Path) -> None:
    trainer = FakeTrainer(_config(tmp_path, slow_in="train", slow_s=0.5))
    control = corun.RunControl()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_stop_when, trainer, "train:1", control)
            outcome = await corun.run(trainer, trainer.run_config, control=control)
    assert outcome.reason == "interrupted" and outcome.step == 1
    # The step in flight was cut at a micro-batch boundary: not counted, not synced.
    assert trainer.calls[-4:] == [
        "train:1", "teardown:weight_sync", "teardown:engine", "on_train_end:interrupted",
    ]  # fmt: skip
    events = _events(tmp_path)
    assert [e for e in events if e.startswith("teardown:") or e == "end"] == TEARDOWN
    # The save on interrupt ran inside its teardown step.
    assert events.index("teardown:stop") < events.index("save") < events.index("teardown:save")
    assert _end(tmp_path)["reason"] == "interrupted"
    # Save on interrupt wrote the last complete step.
    assert checkpoint.latest(tmp_path / "run") == checkpoint.step_dir(tmp_path / "run", 1)


async def test_host_cancellation_tears_down_and_propagates(tmp_path: Path) -> None:
    trainer = FakeTrainer(_config(tmp_path, slow_in="train", slow_s=0.5))
    with anyio.fail_after(30):
        with anyio.CancelScope() as host:
            async with anyio.create_task_group() as tg:

                async def cancel_host() -> None:
                    await trainer.calls.reached("train:1")
                    host.cancel()

                tg.start_soon(cancel_host)
                await corun.run(trainer, trainer.run_config)
            pytest.fail("run() returned after its host was cancelled")
    assert host.cancelled_caught
    assert trainer.calls[-1] == "on_train_end:cancelled"
    assert _events(tmp_path)[-len(TEARDOWN) :] == TEARDOWN
    assert _end(tmp_path)["reason"] == "cancelled"
