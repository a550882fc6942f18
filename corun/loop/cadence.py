"""When the loop syncs, evaluates and saves: one component that owns the arithmetic.

Steps count rollout batches trained; a window of ``accumulate`` steps is one update.
Weights change only at window ends, so every interval is a multiple of the window
(checked when the config is read), and a checkpoint falls on a weight publish.
"""

from __future__ import annotations

from dataclasses import dataclass

from corun.base.config import Config


@dataclass(frozen=True)
class Cadence:
    steps: int  # the run's step budget
    accumulate: int
    sync_every: int
    eval_interval: int  # 0: no periodic eval
    save_interval: int  # 0: only the final save

    @classmethod
    def of(cls, config: Config) -> Cadence:
        loop = config.loop
        return cls(
            steps=config.run.steps,
            accumulate=loop.accumulate,
            sync_every=loop.sync_every,
            eval_interval=loop.eval_interval,
            save_interval=loop.save_interval,
        )

    def window_pos(self, step: int) -> int:
        """Where the batch trained as step ``step + 1`` falls in its window (0-based)."""
        return step % self.accumulate

    def syncs(self, step: int) -> bool:
        """Whether the weights are published after step ``step``."""
        return step % self.sync_every == 0

    def evaluates(self, step: int) -> bool:
        interval = self.eval_interval
        return bool(interval) and (step % interval == 0 or step == self.steps)

    def saves(self, step: int) -> bool:
        interval = self.save_interval
        return (bool(interval) and step % interval == 0) or step == self.steps
