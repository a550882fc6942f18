"""The rollout side of the template: worker tasks that turn data indexes into
batches, each started only when the clock admits it, and tagged with the weight
version it was made with.

Kept apart from template.py so the train side stays one readable loop. Here live the
parts that only async mode exercises: several workers on their own lanes, the
reorder buffer of start-order consumption, and the queue of data indexes whose
batches were dropped as too stale and must be generated again.

A rollout's inputs are fetched from the trainer's dataset in a lane call of their own,
bounded by ``run.data_timeout_s``: a data source that hangs (a stalled network read)
fails the run with one line naming the batch (corun/loop/deadlines.py). A dataset that
declares itself ``in_memory`` (corun/contract/data.py) cannot block: its batch is
computed where the rollout runs, without the extra lane call.
"""

from __future__ import annotations

import heapq
import inspect
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio.abc
from anyio.streams.memory import MemoryObjectSendStream

from corun.base import timebase
from corun.base.config import Config
from corun.base.rng import rollout_generator
from corun.contract.data import Dataset
from corun.contract.trainer import Batch, RolloutContext, Trainer
from corun.execution.compute import Lane
from corun.loop.clock import Clock, IdleTimes
from corun.loop.deadlines import deadline
from corun.loop.extensions import RemoteRollouts
from corun.loop.fused import FusedUpdate
from corun.loop.kept_rollouts import KeptRollouts
from corun.loop.phases import Mark, stopwatch, timed_span
from corun.records.events import EventLog, Trace

_UNFETCHED = object()  # inputs the rollout's own call fetches (an in-memory dataset's)


class Producer:
    """Rollout workers (tasks, each with its own lane) that claim data indexes in order.

    ``order = "start"`` hands batches on in index order, whatever order the workers
    finish in (deterministic; the cursor stays a prefix). ``"completion"`` hands each
    on as soon as it is done (the trainer never waits behind a slow rollout).

    Each rollout gets a :class:`RolloutContext`: its generator is seeded by (run seed,
    index, attempt), where ``attempt`` counts the index's earlier starts (a dropped
    batch is redone with fresh draws); under the fixed version schedule it also names
    the version to generate with.

    Batches kept by the checkpoint a run resumes from (``kept``) are claimed like
    rollouts, through admission, and handed on without one (corun/loop/kept_rollouts.py).
    """

    def __init__(
        self, trainer: Trainer[Any], dataset: Dataset, lanes: list[Lane], clock: Clock,
        idle: IdleTimes, trace: Trace, events: EventLog, config: Config, stop: int,
        kept: KeptRollouts, remote: RemoteRollouts | None = None,
    ) -> None:  # fmt: skip
        self.trainer = trainer
        self.dataset = dataset
        self.lanes = lanes
        self.clock = clock
        self.idle = idle
        self.trace = trace
        self.events = events
        self.order = config.loop.order
        self.concurrency = config.loop.concurrency
        self.seed = config.run.seed
        self.data_timeout_s = config.run.data_timeout_s
        self.in_memory = getattr(dataset, "in_memory", False) is True  # see contract/data.py
        self.fixed_schedule = config.loop.version_schedule == "fixed"
        self.stop = stop  # one past the last data index of the run
        self.remote = remote  # workers in other processes run the rollouts, not the lanes
        # An async rollout (an engine behind I/O) runs on the loop, with no thread hop.
        self.rollout_is_async = inspect.iscoroutinefunction(trainer.rollout)
        self._next_new = clock.cursor
        self._requeued: list[int] = []  # heap: indexes to generate again, lowest first
        self._unsent: list[int] = []  # heap: claimed indexes not yet handed on
        self._finished: dict[int, Batch] = {}  # done, waiting for their turn (start order)
        self._attempts: dict[int, int] = {}  # starts so far, of indexes started more than once
        self.kept = kept
        self._attempts.update(self.kept.attempts())
        # Kept batches that go first (completion order), in the order they had finished.
        self._first = self.kept.first()
        self._skip = set(self._first)  # claimed already: never a new index
        # Taken without a yield when free (each batch takes it once; a yield costs a loop
        # iteration of the template's step).
        self._send_lock = anyio.Lock(fast_acquire=True)
        self._work_added = anyio.Event()
        self._ready_in_place: deque[Batch] = deque()  # produced, not yet taken (concurrency 1)
        self._handed_at: float | None = None  # when the last one was taken (concurrency 1)
        self._fused: FusedUpdate | None = None  # run after each rollout, in its call

    @asynccontextmanager
    async def batches(
        self, fused: FusedUpdate | None = None
    ) -> AsyncIterator[Callable[[], Awaitable[Batch]]]:
        """The trainer's source of batches while inside: awaiting it gives the next one,
        and raises ``anyio.EndOfStream`` once the workers failed (their error surfaces as
        the block exits).

        At concurrency 1 the rollout runs in the awaiting task: a rollout starts only once
        the previous step has completed, so a worker task would have nothing to overlap
        with, and handing its batch over would cost two task switches a step. There, in
        thread compute, a plain rollout's lane call also runs the ``fused`` update
        (corun/loop/fused.py) — not when finished batches are kept for a checkpoint:
        one is recorded as its rollout made it, before its update may replace its data."""
        if self.concurrency == 1 and len(self.lanes) == 1:
            if self.lanes[0].mode == "thread" and not self.kept.enabled:
                self._fused = fused
            yield self._next_in_place
            return
        send, receive = anyio.create_memory_object_stream[Batch](self.concurrency)
        async with anyio.create_task_group() as workers, receive:
            workers.start_soon(self.run, send)
            yield receive.receive
            workers.cancel_scope.cancel()

    async def run(self, send: MemoryObjectSendStream[Batch]) -> None:
        """Produce batches until cancelled (the loop stops it once the budget is trained)."""
        async with send, anyio.create_task_group() as workers:
            for i, lane in enumerate(self.lanes):
                track = "producer" if len(self.lanes) == 1 else f"producer-{i}"
                workers.start_soon(self._work, i, lane, track, send)

    def drop(self, batch: Batch) -> None:
        """``batch`` was overtaken in completion order, too stale to train on: generate
        its data index again."""
        self.clock.drop()
        staleness = self.clock.step - batch.version
        self.events.emit("drop", self.clock.step, index=batch.index, staleness=staleness)
        index = batch.index
        self._attempts[index] = self._attempts.get(index, 0) + 1
        self.kept.dropped(index)
        heapq.heappush(self._requeued, index)
        self._work_added.set()
        self._work_added = anyio.Event()

    async def _work(
        self, worker: int, lane: Lane, track: str, send: MemoryObjectSendStream[Batch]
    ) -> None:
        while True:
            ready = await self._produce(worker, lane, track)
            async with self._send_lock:
                for batch in ready:
                    try:  # into the buffer, or to the waiting trainer, without a yield
                        send.send_nowait(batch)
                    except anyio.WouldBlock:
                        await send.send(batch)

    async def _next_in_place(self) -> Batch:
        """One worker's next batch, in the calling task (concurrency 1: one at a time).

        The time since the previous batch was handed on counts as the generator's idle
        time, as a worker task's wait for admission would (``perf/generator_idle_ratio``)."""
        if self._handed_at is not None:
            self.idle.generator_s += timebase.monotonic() - self._handed_at
        self._handed_at = None
        while not self._ready_in_place:
            self._ready_in_place.extend(await self._produce(0, self.lanes[0], "producer"))
        if self._handed_at is None:  # else handed to the update of its own call
            self._handed_at = timebase.monotonic()
        return self._ready_in_place.popleft()

    async def _produce(self, worker: int, lane: Lane, track: str) -> list[Batch]:
        """Claim an index, make (or take) its batch; the batches that may go on now."""
        index, slot = await self._claim()
        attempt = self._attempts.get(index, 0)
        batch = self.kept.take(index)  # kept by the checkpoint resumed from: no rollout
        if batch is None:
            batch = await self._rollout(worker, lane, track, index, slot, attempt)
        self.kept.finished(batch, attempt)
        self._finished[index] = batch
        return self._ready()

    async def _rollout(
        self, worker: int, lane: Lane, track: str, index: int, slot: int, attempt: int
    ) -> Batch:
        self.idle.rollouts_started += 1
        scheduled = self.clock.scheduled_version(slot) if self.fixed_schedule else None
        ctx = RolloutContext(
            index, rollout_generator(self.seed, index, attempt), attempt, scheduled,
            lane=lane, trace=self.trace, track=track,
        )  # fmt: skip
        version = self.clock.published if scheduled is None else scheduled
        result: Any
        with timed_span(self.trace, "rollout", track, index=index) as rollout:
            inputs = await self._inputs(lane, index)
            if self.remote is not None:
                inputs = self.dataset.batch(index) if inputs is _UNFETCHED else inputs
                result = await self.remote.rollout(worker, inputs, ctx, version)
            elif self.rollout_is_async:
                result = await self._rollout_at(inputs, ctx)
            elif self._fused is not None:  # and then the step's update, in the same call
                result, handed = await lane.run(
                    self._rollout_fused, inputs, ctx, version, self._fused
                )  # fmt: skip
                rollout.ended_at(handed)
                self._handed_at = handed.monotonic
            else:
                result = await lane.run(self._rollout_at, inputs, ctx)
        batch = _as_batch(result, index, version)
        batch.metrics = {**batch.metrics, "perf/rollout_time_s": rollout.seconds}
        return batch

    async def _claim(self) -> tuple[int, int]:
        """The next data index to generate and its admission slot, once the clock
        admits a rollout for it.

        Admission comes first and the claim right after it (no await between), so
        indexes are claimed in slot order. With nothing left to claim the worker waits:
        a dropped batch may still put its index back.
        """
        while True:
            with stopwatch() as waited:
                while not (self._first or self._requeued) and self._upcoming() >= self.stop:
                    await self._work_added.wait()
                slot = await self.clock.admit()
            self.idle.generator_s += waited.seconds
            if self._first:
                index = self._first.pop(0)
            elif self._requeued:
                index = heapq.heappop(self._requeued)
            elif (index := self._upcoming()) < self.stop:
                self._next_new = index + 1
            else:  # another worker took the last one while this one waited
                self.clock.release()
                continue
            heapq.heappush(self._unsent, index)
            return index, slot

    def _upcoming(self) -> int:
        """The next never-claimed index, past those a resumed run trained already."""
        index = self._next_new
        while index in self.clock.trained_ahead or index in self._skip:
            index += 1
        return index

    def _ready(self) -> list[Batch]:
        """Finished batches that may be handed on now, in order."""
        ready = []
        while self._unsent:
            index = self._unsent[0] if self.order == "start" else self._first_finished()
            if index not in self._finished:
                break
            self._unsent.remove(index)
            heapq.heapify(self._unsent)
            ready.append(self._finished.pop(index))
        return ready

    def _first_finished(self) -> int:
        return next(iter(self._finished), -1)

    def _rollout_at(self, inputs: Any, ctx: RolloutContext) -> Any:
        """A batch, or an async rollout's awaitable of one."""
        if inputs is _UNFETCHED:
            inputs = self.dataset.batch(ctx.index)
        return self.trainer.rollout(inputs, ctx)

    def _rollout_fused(
        self, inputs: Any, ctx: RolloutContext, version: int, fused: FusedUpdate
    ) -> tuple[Batch, Mark]:
        """On the lane: the rollout, then the step's update; the batch and when it was
        handed to the update."""
        batch = _as_batch(self._rollout_at(inputs, ctx), ctx.index, version)
        return batch, fused.after_rollout(batch)

    async def _inputs(self, lane: Lane, index: int) -> Any:
        """The dataset's batch ``index``: on the lane within its deadline (a data source
        may block); an in-memory one's is left to where the rollout runs (no thread hop,
        about 0.1 ms a batch on 2 busy cores, for what cannot block)."""
        if self.in_memory:
            return _UNFETCHED
        what = f"the data source's batch {index}"
        with deadline(what, self.data_timeout_s, "run.data_timeout_s"):
            return await lane.run(self.dataset.batch, index)


def _as_batch(result: Any, index: int, version: int) -> Batch:
    """A rollout's result as the batch of data index ``index``, made with ``version``
    unless the trainer said which weights it used."""
    batch = result if isinstance(result, Batch) else Batch(result)
    if batch.version < 0:
        batch.version = version
    batch.index = index
    return batch
