"""Engines that share the trainer's GPU (``SetupContext.share_device``: vLLM with
``engine_options.colocate``) sleep while the trainer steps. A step's order is then
sleep → train → sync → wake, each a traced phase of the template (spans and events
``sleep`` and ``wake``, ``perf/sleep_time_s`` and ``perf/wake_time_s``).

An engine keeps its weights through the sleep (offloaded) only when no weight sync
follows the step (``loop.sync_every`` > 1); before a sync it drops them, and the sync
brings the new ones in. Colocation needs generation and training to alternate
(``loop.concurrency = 1``, checked where the engine starts), so the step's update is
never fused into its rollout's lane call (corun/loop/fused.py): the engine must be
asleep before it runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from corun.contract.engine import SleepingEngine
from corun.loop.cadence import Cadence
from corun.loop.phases import Phases


class Colocation:
    def __init__(self, engines: Sequence[SleepingEngine], cadence: Cadence, phases: Phases):
        self.engines = list(engines)
        self.cadence = cadence
        self.phases = phases

    async def sleep(self, step: int) -> None:
        """Before training step ``step``."""
        if self.engines:
            keep = not self.cadence.syncs(step)
            with self.phases.phase("sleep", "sleep", step=step) as slept:
                for engine in self.engines:
                    await engine.sleep(keep_weights=keep)
                slept.fields = {"keep_weights": keep}

    async def wake(self, step: int) -> None:
        """After step ``step``'s sync, before its evaluation and the next rollout."""
        if self.engines:
            with self.phases.phase("wake", "wake", step=step):
                for engine in self.engines:
                    await engine.wake()
