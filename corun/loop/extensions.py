"""The optional parts of a run, as the loop knows them: built outside it, from the
config (corun/host/runs.py), and handed to the template.

- remote rollouts: workers in other processes (Ray actors, corun/scale/ray_workers.py)
  that run each claimed rollout in place of a lane; the weight sync publishes to them;
- a service beside the run (the policy endpoint, corun/serve/server.py): a task on the
  run's background task group, stopped by a teardown step;
- prerequisite runs: the runs a trainer starts from (``Trainer.prerequisites()``),
  trained before its set-up.

The loop sees only these protocols, so it imports none of corun.scale, corun.serve
or corun.host.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import anyio.abc

from corun.base.errors import ConfigError
from corun.contract.trainer import Batch, RolloutContext, Trainer
from corun.execution.compute import Lane
from corun.loop.clock import Clock
from corun.records.events import EventLog


class RemoteRollouts(Protocol):
    """Rollout workers in other processes, started in set-up (teardown step
    ``rollout_workers``)."""

    async def rollout(self, worker: int, inputs: Any, ctx: RolloutContext, version: int) -> Batch:
        """``ctx``'s rollout of ``inputs`` with ``version``'s weights, on ``worker``."""
        ...

    async def publish(self, version: int) -> None:
        """Hand the trainer's current weights on as ``version`` (in the weight sync)."""
        ...

    async def stop(self) -> None: ...


# Start the run's remote workers (how many, the run's clock, events and train lane), the
# published version's weights in place.
OpenRemoteRollouts = Callable[[int, Clock, EventLog, Lane], Awaitable[RemoteRollouts]]


class Service(Protocol):
    """A task beside the run: on the background task group, so a stop of the run never
    cuts it short; its ``stop`` is the teardown step ``endpoint``."""

    async def run(self, *, task_status: anyio.abc.TaskStatus[str] = ...) -> None:
        """Serve until stopped; report the URL once listening."""
        ...

    async def stop(self) -> None: ...


# Made once the trainer is set up (it serves the trainer's policy).
OpenService = Callable[[], Service]


class Prerequisites(Protocol):
    """How the runs a trainer starts from are trained (by the same assembled run)."""

    def complete(self, config: Path) -> bool:
        """Whether the run ``config`` configures is complete already (it is reused)."""
        ...

    async def train(self, config: Path) -> None: ...


@dataclass(frozen=True)
class Extensions:
    """The optional parts of one run; none by default (the bare template)."""

    remote: OpenRemoteRollouts | None = None
    service: OpenService | None = None
    prerequisites: Prerequisites | None = None

    async def train_prerequisites(self, trainer: Trainer[Any], events: EventLog, step: int) -> None:
        """Train the runs ``trainer`` starts from, unless complete already."""
        for config in map(Path, trainer.prerequisites()):
            if self.prerequisites is None:
                raise ConfigError(f"{config}: a prerequisite run: train through corun.run")
            reused = self.prerequisites.complete(config)
            events.emit("prerequisite", step, config=str(config), reused=reused)
            if not reused:
                await self.prerequisites.train(config)  # nested: a stop of this run cancels it too
