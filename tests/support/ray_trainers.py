"""Trainers for tests/test_ray.py, importable by the Ray actors' processes."""

from __future__ import annotations

import os
import time
from typing import Any

from corun import Batch, RolloutContext
from trainers.lm.grpo import GRPOTrainer


class DyingGRPO(GRPOTrainer):
    """GRPO whose rollout worker process dies (``os._exit``) in the middle of the
    rollout of data index 2, once per run (a marker file in the run dir)."""

    def rollout(self, examples: list[tuple[str, str]], ctx: RolloutContext) -> Batch:
        marker = self.run_config.run_dir / "worker-died"
        if ctx.index == 2 and not marker.exists():
            marker.write_text(str(os.getpid()))
            os._exit(1)
        batch: Any = super().rollout(examples, ctx)
        return batch


class HangingGRPO(GRPOTrainer):
    """GRPO whose update hangs on the driver from data index 2 on (after writing the
    marker ``phase-hang`` in the run dir): a stop cannot get past the train lane, so
    only the hard-exit path (or a SIGKILL) ends the run and its Ray cluster."""

    def prepare(self, batch: Batch) -> Any:
        if batch.index >= 2:
            (self.run_config.run_dir / "phase-hang").write_text(str(os.getpid()))
            while True:
                time.sleep(1)
        return super().prepare(batch)
