"""The version clock: steps, policy versions, the data cursor, and rollout admission.

``version`` is the policy version of the trained weights: updates applied (one per
window of ``accumulate`` steps, however many optimizer steps it takes); ``published``
is the version the rollout engine holds. Each admitted rollout takes a *slot*: its expected place in
training order (slots of dropped batches are given back). A rollout is admitted
when fewer than ``concurrency`` slots are ahead of the last completed step, and
when the batch it makes would be at most ``max_staleness`` versions old if trained
in its slot. In start order every batch trains in its slot, so no batch is ever
over the bound; in completion order a slow batch can be overtaken, and the loop
drops it (``dropped``) and its data index is generated again.

Under ``version_schedule = "fixed"`` the rollout of slot ``i`` uses exactly the
version :meth:`Clock.scheduled_version` assigns it — a function of ``i`` and the
settings, never of timing — which admission guarantees is published by then.

The data cursor is exact in both orders: ``cursor`` is the lowest index not yet
trained and ``trained_ahead`` the indexes above it that were (completion order
only). A checkpoint records both, so a resumed run trains every index once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio

from corun.base import timebase
from corun.base.config import LoopConfig

if TYPE_CHECKING:
    from corun.records.checkpoint import TrainerState


@dataclass
class Clock:
    concurrency: int
    max_staleness: int  # in versions
    accumulate: int = 1  # steps per version (update)
    sync_every: int = 1  # steps per publish (a multiple of accumulate)
    fixed_schedule: bool = False
    step: int = 0  # steps trained (rollout batches consumed)
    version: int = 0  # policy version: updates applied, step // accumulate
    published: int = 0  # version the rollout engine holds
    cursor: int = 0  # lowest data index not yet trained
    trained_ahead: set[int] = field(default_factory=set)  # trained indexes above it
    done: int = 0  # steps whose whole body (sync, eval, save) has finished
    slots: int = 0  # rollouts admitted, less those dropped: the next one's place in order
    dropped: int = 0  # batches over the staleness bound, never trained
    _changed: anyio.Event | None = None  # made by the first waiter of a change
    # Queues waiting workers; taken without a yield when free (a step's admission waits
    # on it once at concurrency 1, and a yield costs a loop iteration).
    _admitting: anyio.Lock = field(default_factory=lambda: anyio.Lock(fast_acquire=True))

    def __post_init__(self) -> None:
        # Where the current window started: a save in mid-window goes back to it.
        self.window_start = self.position()

    @classmethod
    def start(
        cls, loop: LoopConfig, step: int, version: int, cursor: int, trained_ahead: list[int]
    ) -> Clock:
        return cls(
            concurrency=loop.concurrency,
            max_staleness=loop.staleness_bound,
            accumulate=loop.accumulate,
            sync_every=loop.sync_every,
            fixed_schedule=loop.version_schedule == "fixed",
            step=step,
            version=version,
            published=version,
            cursor=cursor,
            trained_ahead=set(trained_ahead),
            done=step,
            slots=step,
        )

    @classmethod
    def resume(cls, loop: LoopConfig, state: TrainerState | None) -> Clock:
        """The clock of a fresh run (no ``state``), or of one resumed from a checkpoint."""
        if state is None:
            return cls.start(loop, step=0, version=0, cursor=0, trained_ahead=[])
        return cls.start(
            loop, step=state.step, version=state.version, cursor=state.data_cursor,
            trained_ahead=state.trained_ahead,
        )  # fmt: skip

    def admissible(self) -> bool:
        ahead = self.slots - self.done
        staleness = self.slots // self.accumulate - self.published  # version it trains at
        if self.fixed_schedule and self.published < self.scheduled_version(self.slots):
            return False
        return ahead < self.concurrency and staleness <= self.max_staleness

    async def admit(self) -> int:
        """Wait until another rollout may start; take its slot and return it.

        Waiting workers queue (first come, first admitted) and only the first waits on
        the clock, so a change wakes one worker, not all of them (1,000 workers:
        ``corun simulate``).
        """
        if self._admitting.locked() or not self.admissible():
            async with self._admitting:
                while not self.admissible():
                    await self.changed()
        self.slots += 1
        return self.slots - 1

    def scheduled_version(self, slot: int) -> int:
        """The version the rollout of ``slot`` uses under the fixed schedule: the newest
        one admission can always have published by then (after step ``slot -
        concurrency + 1``), raised to the oldest one the staleness bound allows."""
        per_publish = self.sync_every // self.accumulate  # versions between publishes
        earliest = max(0, slot - self.concurrency + 1)
        published = earliest // self.sync_every * per_publish
        oldest_allowed = max(0, slot // self.accumulate - self.max_staleness)
        return max(published, -(-oldest_allowed // per_publish) * per_publish)

    def release(self) -> None:
        """Give back a slot taken by a rollout that did not start."""
        self.slots -= 1
        self._notify()

    def is_stale(self, version: int) -> bool:
        """Whether a batch made with ``version`` is over the bound if trained now."""
        return self.version - version > self.max_staleness

    def drop(self) -> None:
        """A batch was over the bound: its slot is free for the rollout that redoes it."""
        self.dropped += 1
        self.release()

    def trained(self, index: int) -> None:
        self.step += 1
        self.trained_ahead.add(index)
        while self.cursor in self.trained_ahead:
            self.trained_ahead.remove(self.cursor)
            self.cursor += 1
        if self.step % self.accumulate == 0:
            self.version += 1
            self.window_start = self.position()

    def position(self) -> Position:
        """Where training stands now."""
        return Position(self.step, self.version, self.cursor, frozenset(self.trained_ahead))

    def rewind(self, position: Position) -> None:
        """Back to ``position`` (teardown only: a save-on-interrupt in mid-window)."""
        self.step, self.version, self.cursor = position.step, position.version, position.cursor
        self.trained_ahead = set(position.trained_ahead)

    @property
    def inflight(self) -> int:
        """Batches admitted and not yet trained, counting the one in the current step."""
        return self.slots - self.done

    def async_metrics(self, staleness: int) -> dict[str, float]:
        """A step's ``async/*`` metrics above concurrency 1, its batch ``staleness``
        versions old (one batch per step: the step's mean and max)."""
        if self.concurrency == 1:
            return {}
        return {
            "async/staleness_mean": float(staleness), "async/staleness_max": float(staleness),
            "async/inflight": float(self.inflight), "async/dropped": float(self.dropped),
        }  # fmt: skip

    def publish(self, version: int) -> None:
        """The rollout engine now holds ``version``."""
        self.published = version
        self._notify()

    def completed(self) -> None:
        self.done = self.step
        self._notify()

    async def changed(self) -> None:
        """Wait for the next change of step, version or publish."""
        if self._changed is None:
            self._changed = anyio.Event()
        await self._changed.wait()

    def _notify(self) -> None:
        # An event only while someone waits: a step notifies twice (publish, completed).
        if self._changed is not None:
            self._changed.set()
            self._changed = None


@dataclass(frozen=True)
class Position:
    step: int
    version: int
    cursor: int
    trained_ahead: frozenset[int]


@dataclass
class IdleTimes:
    """How long the trainer waited for batches and the producer waited for admission,
    as shares of the wall time since the previous step (``perf/*_idle_ratio``)."""

    trainer_s: float = 0.0
    generator_s: float = 0.0
    rollouts_started: int = 0
    _mark: float = field(default_factory=timebase.monotonic)

    def take(self) -> dict[str, float]:
        now = timebase.monotonic()
        span = max(now - self._mark, 1e-9)
        ratios = {
            "perf/trainer_idle_ratio": min(self.trainer_s / span, 1.0),
            "perf/generator_idle_ratio": min(self.generator_s / span, 1.0),
        }
        self.trainer_s = self.generator_s = 0.0
        self._mark = now
        return ratios
