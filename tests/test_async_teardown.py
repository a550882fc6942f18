"""Async mode (concurrency > 1, rollout workers on their own lanes): a stop in every
phase, and a failure in a producer or in the weight sync, tear down in the
documented order, on asyncio and trio."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

import corun
from corun.records import checkpoint
from corun.records.events import read_records
from tests.support.config import make_config
from tests.support.fakes import TEARDOWN_ORDER, FakeError, FakeTrainer

pytestmark = pytest.mark.anyio

ASYNC_LOOP = {"concurrency": 3, "workers": 2, "max_staleness": 2, "save_interval": 2}


def _trainer(run_dir: Path, **trainer: object) -> FakeTrainer:
    config = make_config(
        run_dir, {"kind": "tests.support.fakes:FakeTrainer", **trainer}, run={"steps": 6},
        loop=ASYNC_LOOP,
    )  # fmt: skip
    return FakeTrainer(config)


def _teardown_events(run_dir: Path) -> list[str]:
    names = [r["event"] for r in read_records(run_dir / "events.jsonl")]
    return [n for n in names if n.startswith("teardown:") or n == "end"]


@pytest.mark.parametrize("phase", ["rollout", "train", "sync", "save"])
async def test_stop_in_each_async_phase(tmp_path: Path, phase: str) -> None:
    run_dir = tmp_path / "run"
    trainer = _trainer(run_dir, slow_in=phase, slow_s=0.3)
    control = corun.RunControl()

    async def stop_in_phase() -> None:
        await trainer.phases.reached(phase)
        control.stop("interrupted", signal="SIGINT")

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_in_phase)
            outcome = await corun.run(trainer, trainer.run_config, control=control)
    assert outcome.reason == "interrupted"
    assert _teardown_events(run_dir) == [*TEARDOWN_ORDER, "end"]
    assert trainer.calls[-1] == "on_train_end:interrupted"
    latest = checkpoint.latest(run_dir)
    if latest is not None:
        checkpoint.read(latest)  # whatever was saved loads


@pytest.mark.parametrize("phase", ["rollout", "sync"])
async def test_failure_in_producer_or_sync_surfaces(tmp_path: Path, phase: str) -> None:
    run_dir = tmp_path / "run"
    trainer = _trainer(run_dir, fail_in=phase, fail_at_step=3)
    with anyio.fail_after(60), pytest.raises(FakeError, match=f"failure in {phase}"):
        await corun.run(trainer, trainer.run_config)
    assert _teardown_events(run_dir) == [*TEARDOWN_ORDER, "end"]
    assert read_records(run_dir / "events.jsonl")[-1]["reason"] == "error"
    assert trainer.calls[-1] == "on_train_end:error"


async def test_async_resume_trains_every_index_once(tmp_path: Path) -> None:
    """Buffers start empty on resume and the cursor is exact: what was in flight at
    the checkpoint is generated again, and nothing is skipped or trained twice."""
    run_dir = tmp_path / "run"
    trained: list[str] = []
    with anyio.fail_after(60):
        for steps in (4, 8):
            config = make_config(
                run_dir, {"kind": "tests.support.fakes:FakeTrainer"}, run={"steps": steps},
                loop=ASYNC_LOOP,
            )  # fmt: skip
            trainer = FakeTrainer(config)
            await corun.run(trainer, config)
            trained += [c for c in trainer.calls if c.startswith("train:")]
    assert trained == [f"train:{i}" for i in range(8)]
