"""Admission under random latencies, on trio's virtual clock: the staleness bound and
the concurrency window always hold, every data index is trained exactly once, and
every run finishes (no deadlock, no starvation) — in start order and in completion
order (where overtaken batches are dropped and redone), with the fixed version
schedule (where the versions do not depend on timing), and with injected failures.

Hooks are ``async def`` that sleep for latencies drawn by hypothesis; with
``MockClock(autojump_threshold=0)`` hours of virtual time pass in milliseconds.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import anyio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

import corun
from corun.records.events import read_records
from tests.support.config import make_config


class LatencyConfig(corun.TrainerConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    rollout_s: tuple[float, ...] = (0.0,)
    train_s: tuple[float, ...] = (0.0,)
    fail_in: str = ""  # "rollout" | "train": raise LatencyError there ...
    fail_at: int = 0  # ... for this data index


class LatencyError(RuntimeError):
    pass


class LatencyTrainer(corun.Trainer[LatencyConfig]):
    """Does nothing but wait; records what admission let happen."""

    Config = LatencyConfig

    def setup(self, ctx: corun.SetupContext) -> None:
        self.trained = 0
        self.started = 0
        self.staleness: list[int] = []
        self.window: list[int] = []
        self.trained_indexes: list[int] = []
        self.rollout_indexes: list[int] = []
        self.versions: list[int] = []  # of each trained batch, in training order

    async def rollout(self, inputs: Any, ctx: corun.RolloutContext) -> corun.Batch:
        index = ctx.index
        self.started += 1
        self.window.append(self.started - self.trained)
        self.rollout_indexes.append(index)
        await anyio.sleep(self.config.rollout_s[index % len(self.config.rollout_s)])
        if self.config.fail_in == "rollout" and index == self.config.fail_at:
            raise LatencyError(f"rollout {index}")
        return corun.Batch(inputs)

    async def train_step(self, batch: corun.Batch) -> dict[str, float]:
        version = self.trained // self.run_config.loop.accumulate
        self.staleness.append(version - batch.version)
        self.versions.append(batch.version)
        await anyio.sleep(self.config.train_s[batch.index % len(self.config.train_s)])
        if self.config.fail_in == "train" and batch.index == self.config.fail_at:
            raise LatencyError(f"train {batch.index}")
        self.trained += 1
        self.trained_indexes.append(batch.data)
        return {}

    async def sync_weights(self, version: int) -> None:
        await anyio.sleep(0.001)


latencies = st.lists(st.floats(0.0, 2.0), min_size=1, max_size=8)


def run_virtual(run_dir: Path, trainer_table: dict[str, Any], **sections: Any) -> Any:
    """Run a LatencyTrainer under trio's virtual clock; returns (trainer, outcome or error)."""
    config = make_config(run_dir, trainer_table, **sections)
    trainer = LatencyTrainer(config)

    async def bounded() -> corun.Outcome:
        with anyio.fail_after(10_000):  # virtual seconds: a deadlock would hit it
            return await corun.run(trainer, config)

    try:
        result: Any = anyio.run(
            bounded, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)}
        )
    except LatencyError as exc:
        result = exc
    return trainer, result


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rollout_s=latencies,
    train_s=latencies,
    concurrency=st.integers(1, 4),
    sync_interval=st.integers(1, 3),
    extra_staleness=st.integers(0, 3),
    windows=st.integers(1, 12),
    workers=st.integers(1, 4),
    order=st.sampled_from(["start", "completion", "start-fixed"]),
    accumulate=st.sampled_from([1, 1, 2, 3]),
)
def test_staleness_and_window_bounds_hold(
    rollout_s: list[float], train_s: list[float], concurrency: int, sync_interval: int,
    extra_staleness: int, windows: int, workers: int, order: str, accumulate: int,
) -> None:  # fmt: skip
    order, _, schedule = order.partition("-")
    sync_interval *= accumulate
    steps = windows * accumulate
    max_staleness = sync_interval // accumulate - 1 + extra_staleness
    workers = min(workers, concurrency)
    loop = {
        "concurrency": concurrency, "sync_interval": sync_interval,
        "max_staleness": max_staleness, "baseline_eval": False, "workers": workers,
        "accumulate": accumulate, "order": order, "version_schedule": schedule or "free",
        "compute": "inline",  # no threads: virtual time sees every wait
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as run_dir:
        trainer, outcome = run_virtual(
            Path(run_dir),
            {"kind": "tests.test_admission:LatencyTrainer", "rollout_s": rollout_s,
             "train_s": train_s},
            run={"steps": steps}, loop=loop,
        )  # fmt: skip
        records = [r for r in read_records(Path(run_dir) / "metrics.jsonl") if "step" in r]
        drops = [e for e in read_records(Path(run_dir) / "events.jsonl") if e["event"] == "drop"]
    steps_logged = [r for r in records if "perf/trainer_idle_ratio" in r]
    assert len(steps_logged) == steps
    for record in steps_logged:
        assert 0.0 <= record["perf/trainer_idle_ratio"] <= 1.0
        assert 0.0 <= record["perf/generator_idle_ratio"] <= 1.0
        if concurrency > 1:
            assert 1 <= record["async/inflight"] <= concurrency
            assert record["async/staleness_max"] <= max_staleness
    assert outcome.reason == "done" and trainer.trained == steps
    assert max(trainer.staleness) <= max_staleness
    if schedule == "fixed":
        # Other timings, the same versions: the schedule is a function of the index.
        with tempfile.TemporaryDirectory() as run_dir:
            other, _ = run_virtual(
                Path(run_dir),
                {"kind": "tests.test_admission:LatencyTrainer",
                 "rollout_s": [0.0, *reversed(rollout_s)], "train_s": list(reversed(train_s))},
                run={"steps": steps}, loop=loop,
            )  # fmt: skip
        assert other.versions == trainer.versions
    if order == "start":
        # Nothing overtakes in start order, so nothing is dropped and the window holds
        # for every rollout; batches train in index order even when workers finish
        # out of order.
        assert not drops
        assert max(trainer.window) <= concurrency
        assert trainer.trained_indexes == list(range(steps))
    else:
        # Each index trained once, none skipped; each drop redid its index once more.
        assert sorted(trainer.trained_indexes) == list(range(steps))
        assert len(trainer.rollout_indexes) == steps + len(drops)
        if drops:
            assert steps_logged[-1]["async/dropped"] == len(drops)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rollout_s=latencies,
    train_s=latencies,
    concurrency=st.integers(1, 4),
    workers=st.integers(1, 4),
    order=st.sampled_from(["start", "completion"]),
    fail_in=st.sampled_from(["rollout", "train"]),
    fail_at=st.integers(0, 7),
)
def test_a_failure_anywhere_ends_the_run_with_that_error(
    rollout_s: list[float], train_s: list[float], concurrency: int, workers: int, order: str,
    fail_in: str, fail_at: int,
) -> None:  # fmt: skip
    with tempfile.TemporaryDirectory() as run_dir:
        _, result = run_virtual(
            Path(run_dir),
            {"kind": "tests.test_admission:LatencyTrainer", "rollout_s": rollout_s,
             "train_s": train_s, "fail_in": fail_in, "fail_at": fail_at},
            run={"steps": 8},
            loop={"concurrency": concurrency, "workers": min(workers, concurrency),
                  "baseline_eval": False, "order": order, "compute": "inline"},
        )  # fmt: skip
        events = [e["event"] for e in read_records(Path(run_dir) / "events.jsonl")]
        end = read_records(Path(run_dir) / "events.jsonl")[-1]
    assert isinstance(result, LatencyError) and str(result) == f"{fail_in} {fail_at}"
    assert events[-1] == "end" and end["reason"] == "error"
    assert "teardown:logging" in events


def test_completion_order_resume_trains_every_index_once(tmp_path: Path) -> None:
    """A checkpoint taken while index 0 is still generating records the cursor (0) and
    the indexes above it already trained; a run resumed from it redoes 0, skips those."""
    table = {"kind": "tests.test_admission:LatencyTrainer", "rollout_s": (9.0,) + (0.5,) * 7}
    loop = {"concurrency": 3, "workers": 3, "max_staleness": 10, "order": "completion",
            "baseline_eval": False, "save_interval": 4, "compute": "inline"}  # fmt: skip
    first, outcome = run_virtual(tmp_path / "a", table, run={"steps": 8}, loop=loop)
    assert outcome.reason == "done"
    step_4 = tmp_path / "a" / "checkpoints" / "step-4"
    state = json.loads((step_4 / "state.json").read_text())
    assert state["data_cursor"] == 0 and state["trained_ahead"] == [1, 2, 3, 4]
    resumed, outcome = run_virtual(
        tmp_path / "b", table, run={"steps": 8}, loop=loop, checkpoint={"resume": str(step_4)}
    )
    assert outcome.reason == "done"
    assert sorted(first.trained_indexes[:4]) == [1, 2, 3, 4]
    assert sorted(resumed.trained_indexes) == [0, 5, 6, 7]
    state = json.loads((tmp_path / "b" / "checkpoints" / "step-8" / "state.json").read_text())
    assert state["data_cursor"] == 8 and state["trained_ahead"] == []
