"""The version clock: steps, weight versions, the data cursor, and rollout admission.

``version`` counts optimizer steps applied; ``published`` is the version the
rollout engine holds. A rollout for data index ``i`` is admitted when fewer than
``concurrency`` batches are ahead of the last completed step, and when the batch
it makes would be at most ``max_staleness`` versions old at train time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import anyio

from corun.config import LoopConfig


@dataclass
class Clock:
    concurrency: int
    max_staleness: int
    step: int = 0  # optimizer steps trained
    version: int = 0  # weight version; one update per step, so == step
    published: int = 0  # version the rollout engine holds
    cursor: int = 0  # data index of the next batch to train on
    done: int = 0  # steps whose whole body (sync, eval, save) has finished
    _changed: anyio.Event = field(default_factory=anyio.Event)

    @classmethod
    def start(cls, loop: LoopConfig, step: int, version: int, cursor: int) -> Clock:
        return cls(
            concurrency=loop.concurrency,
            max_staleness=loop.staleness_bound,
            step=step,
            version=version,
            published=version,
            cursor=cursor,
            done=step,
        )

    @property
    def version_published(self) -> int:
        return self.published

    def admissible(self, index: int) -> bool:
        ahead = index - self.done
        staleness = index - self.published
        return ahead < self.concurrency and staleness <= self.max_staleness

    async def admit(self, index: int) -> None:
        """Wait until a rollout for data index ``index`` may start."""
        while not self.admissible(index):
            await self._changed.wait()

    def trained(self, index: int) -> None:
        self.step += 1
        self.version += 1
        self.cursor = index + 1

    def published_version(self, version: int) -> None:
        self.published = version
        self._notify()

    def completed(self) -> None:
        self.done = self.step
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


@dataclass
class IdleTimes:
    """How long the trainer waited for batches and the producer waited for admission,
    as shares of the wall time since the previous step (``perf/*_idle_ratio``)."""

    trainer_s: float = 0.0
    generator_s: float = 0.0
    rollouts_started: int = 0
    _mark: float = field(default_factory=time.monotonic)

    def take(self) -> dict[str, float]:
        now = time.monotonic()
        span = max(now - self._mark, 1e-9)
        ratios = {
            "perf/trainer_idle_ratio": min(self.trainer_s / span, 1.0),
            "perf/generator_idle_ratio": min(self.generator_s / span, 1.0),
        }
        self.trainer_s = self.generator_s = 0.0
        self._mark = now
        return ratios
