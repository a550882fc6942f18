"""Admission under random latencies, on trio's virtual clock: the staleness bound and
the concurrency window always hold, and every run finishes (no deadlock).

Hooks are ``async def`` that sleep for latencies drawn by hypothesis; with
``MockClock(autojump_threshold=0)`` hours of virtual time pass in milliseconds.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import anyio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

import corun
from corun.events import read_jsonl
from tests.conftest import make_config


class LatencyConfig(corun.TrainerConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    rollout_s: tuple[float, ...] = (0.0,)
    train_s: tuple[float, ...] = (0.0,)


class LatencyTrainer(corun.Trainer[LatencyConfig]):
    """Does nothing but wait; records what admission let happen."""

    Config = LatencyConfig

    def setup(self, ctx: corun.SetupContext) -> None:
        self.trained = 0
        self.started = 0
        self.staleness: list[int] = []
        self.window: list[int] = []
        self.trained_indexes: list[int] = []

    async def rollout(self, inputs: Any, step: int) -> corun.Batch:
        self.started += 1
        self.window.append(self.started - self.trained)
        await anyio.sleep(self.config.rollout_s[step % len(self.config.rollout_s)])
        return corun.Batch(inputs)

    async def train_step(self, batch: corun.Batch) -> dict[str, float]:
        self.staleness.append(self.trained - batch.version)
        await anyio.sleep(self.config.train_s[batch.step % len(self.config.train_s)])
        self.trained += 1
        self.trained_indexes.append(batch.data)
        return {}

    async def sync_weights(self, version: int) -> None:
        await anyio.sleep(0.001)


latencies = st.lists(st.floats(0.0, 2.0), min_size=1, max_size=8)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rollout_s=latencies,
    train_s=latencies,
    concurrency=st.integers(1, 4),
    sync_interval=st.integers(1, 3),
    extra_staleness=st.integers(0, 3),
    steps=st.integers(1, 12),
    workers=st.integers(1, 4),
)
def test_staleness_and_window_bounds_hold(
    rollout_s: list[float], train_s: list[float], concurrency: int, sync_interval: int,
    extra_staleness: int, steps: int, workers: int,
) -> None:  # fmt: skip
    max_staleness = sync_interval - 1 + extra_staleness
    workers = min(workers, concurrency)
    with tempfile.TemporaryDirectory() as run_dir:
        config = make_config(
            Path(run_dir),
            {"kind": "tests.test_admission:LatencyTrainer", "rollout_s": rollout_s,
             "train_s": train_s},
            run={"steps": steps},
            loop={"concurrency": concurrency, "sync_interval": sync_interval,
                  "max_staleness": max_staleness, "baseline_eval": False, "workers": workers,
                  "compute": "inline"},  # no threads: the virtual clock sees every wait
        )  # fmt: skip
        trainer = LatencyTrainer(config)

        async def bounded() -> corun.Outcome:
            with anyio.fail_after(10_000):  # virtual seconds: a deadlock would hit it
                return await corun.run(trainer, config)

        outcome = anyio.run(
            bounded, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)}
        )
        records = [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "step" in r]
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
    assert max(trainer.window) <= concurrency
    # Each batch once, none skipped, in start order even when workers finish out of order.
    assert trainer.trained_indexes == list(range(steps))
