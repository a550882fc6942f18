"""The weight sync: the trained weights published to the rollout side, when the cadence
says (and once after a resume: the engine booted with fresh weights).

A sync is the trainer's ``sync_weights(version)`` on the train lane, then the remote
rollout workers' publish, both under ``run.sync_timeout_s`` (corun/loop/deadlines.py);
then the clock holds the version as published, and the sync is recorded (span and
event ``sync``, ``perf/sync_time_s``). A trainer without ``sync_weights`` (its rollout
reads the live weights) publishes on the clock only, with no record.
"""

from __future__ import annotations

from typing import Any

from corun.base.config import Config
from corun.contract.trainer import Trainer, overrides
from corun.execution.compute import Lane, call_hook
from corun.loop.cadence import Cadence
from corun.loop.clock import Clock
from corun.loop.deadlines import deadline
from corun.loop.extensions import RemoteRollouts
from corun.loop.phases import Phases


class WeightSync:
    def __init__(
        self, trainer: Trainer[Any], config: Config, clock: Clock, lane: Lane, phases: Phases
    ) -> None:
        self.trainer = trainer
        self.cadence = Cadence.of(config)
        self.timeout_s = config.run.sync_timeout_s
        self.clock = clock
        self.lane = lane
        self.phases = phases
        self.syncs = overrides(trainer, "sync_weights")
        self.remote: RemoteRollouts | None = None  # set once the run has opened them

    async def after(self, step: int) -> None:
        """The sync after step ``step``, if the cadence has one there."""
        if self.cadence.syncs(step):
            await self.sync()

    async def sync(self, forced: bool = False) -> None:
        version = self.clock.version
        if not self.syncs:
            self.clock.publish(version)
            return
        with self.phases.phase("sync", "sync", version=version) as sync:
            what = f"weight sync to version {version}"
            with deadline(what, self.timeout_s, "run.sync_timeout_s"):
                weights = await call_hook(self.lane, self.trainer.sync_weights, version)
                if self.remote is not None:
                    await self.remote.publish(version)
            self.clock.publish(version)
            sync.fields = {"version": version, "forced": True} if forced else {"version": version}
            if isinstance(weights, str) and weights:
                sync.fields["weights"] = weights
