"""The rollout side of the template: a producer task that turns data indexes into
batches, each started only when the clock admits it, and tagged with the weight
version it was made with.

Kept apart from loop.py because the async issues grow here (several workers on
their own lanes, a reorder buffer for start-order consumption, requeueing dropped
batches) while the train side stays one readable loop.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import anyio.abc

from corun.clock import Clock, IdleTimes
from corun.compute import Lane
from corun.data import Dataset
from corun.events import Trace
from corun.trainer import Batch, Trainer


class Producer:
    def __init__(
        self, trainer: Trainer[Any], dataset: Dataset, lane: Lane, clock: Clock,
        idle: IdleTimes, trace: Trace,
    ) -> None:  # fmt: skip
        self.trainer = trainer
        self.dataset = dataset
        self.lane = lane
        self.clock = clock
        self.idle = idle
        self.trace = trace
        # An async rollout (an engine behind I/O) runs on the loop, with no thread hop.
        self.rollout_is_async = inspect.iscoroutinefunction(trainer.rollout)

    async def run(self, send: anyio.abc.ObjectSendStream[Batch], stop: int) -> None:
        """Produce the batches for data indexes from the clock's cursor up to ``stop``."""
        async with send:
            for index in range(self.clock.cursor, stop):
                waiting = time.monotonic()
                await self.clock.admit(index)
                started = time.monotonic()
                self.idle.generator_s += started - waiting
                self.idle.rollouts_started += 1
                version = self.clock.version_published
                with self.trace.span("rollout", "producer", index=index):
                    if self.rollout_is_async:
                        result = await self._rollout_at(index)
                    else:
                        result = await self.lane.run(self._rollout_at, index)
                batch = result if isinstance(result, Batch) else Batch(result)
                batch.version, batch.step = version, index
                batch.metrics = {**batch.metrics, "perf/rollout_time_s": time.monotonic() - started}
                await send.send(batch)

    def _rollout_at(self, index: int) -> Any:
        return self.trainer.rollout(self.dataset.batch(index), index)
