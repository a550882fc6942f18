"""Trainers for tests/test_ray.py, importable by the Ray actors' processes."""

from __future__ import annotations

import os
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
