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
    """Rollout workers (tasks, each with its own lane) that claim data indexes in order
    and hand the batches on in that same order (start order), so the data cursor is
    always a prefix: everything below it trained, nothing above it."""

    def __init__(
        self, trainer: Trainer[Any], dataset: Dataset, lanes: list[Lane], clock: Clock,
        idle: IdleTimes, trace: Trace,
    ) -> None:  # fmt: skip
        self.trainer = trainer
        self.dataset = dataset
        self.lanes = lanes
        self.clock = clock
        self.idle = idle
        self.trace = trace
        # An async rollout (an engine behind I/O) runs on the loop, with no thread hop.
        self.rollout_is_async = inspect.iscoroutinefunction(trainer.rollout)
        self._next_index = clock.cursor
        self._next_to_send = clock.cursor
        self._finished: dict[int, Batch] = {}  # done out of order, waiting for their turn
        self._send_lock = anyio.Lock()

    async def run(self, send: anyio.abc.ObjectSendStream[Batch], stop: int) -> None:
        """Produce the batches for data indexes from the clock's cursor up to ``stop``."""
        async with send, anyio.create_task_group() as workers:
            for i, lane in enumerate(self.lanes):
                track = "producer" if len(self.lanes) == 1 else f"producer-{i}"
                workers.start_soon(self._work, lane, track, send, stop)

    async def _work(
        self, lane: Lane, track: str, send: anyio.abc.ObjectSendStream[Batch], stop: int
    ) -> None:
        while (index := self._next_index) < stop:
            self._next_index += 1
            waiting = time.monotonic()
            await self.clock.admit(index)
            started = time.monotonic()
            self.idle.generator_s += started - waiting
            self.idle.rollouts_started += 1
            version = self.clock.version_published
            with self.trace.span("rollout", track, index=index):
                if self.rollout_is_async:
                    result = await self._rollout_at(index)
                else:
                    result = await lane.run(self._rollout_at, index)
            batch = result if isinstance(result, Batch) else Batch(result)
            if batch.version < 0:  # the trainer did not say which weights it used
                batch.version = version
            batch.step = index
            batch.metrics = {**batch.metrics, "perf/rollout_time_s": time.monotonic() - started}
            self._finished[index] = batch
            async with self._send_lock:
                while self._next_to_send in self._finished:
                    await send.send(self._finished.pop(self._next_to_send))
                    self._next_to_send += 1

    def _rollout_at(self, index: int) -> Any:
        return self.trainer.rollout(self.dataset.batch(index), index)
