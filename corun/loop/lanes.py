"""The run's compute lanes (corun/execution/compute.py): the train lane, and the rollout
workers' (``loop.workers``). At concurrency 1 rollout and training share the train
lane, in order (exactly a hand-written loop); above it, each rollout worker has a lane
of its own.
"""

from __future__ import annotations

from corun.base.config import Config
from corun.execution.compute import Lane
from corun.execution.cores import side_by_side


def lane(config: Config, name: str) -> Lane:
    """A lane of the run (the endpoint's too): its compute mode, its torch threads and
    its share of the cores."""
    loop = config.loop
    return Lane(name, loop.compute, loop.lane_threads, side_by_side(config), loop.adapt_threads)


class Lanes:
    def __init__(self, config: Config) -> None:
        self.train = lane(config, "train")
        workers = [lane(config, f"rollout-{i}") for i in range(config.loop.workers)]
        self.rollout = [self.train] if config.loop.concurrency == 1 else workers

    def close(self) -> None:
        for each in {self.train, *self.rollout}:
            each.close()
