"""The learning rate over a run: a factor of each optimizer's own rate, per update.

``loop.lr_schedule`` = "constant" leaves the rates alone. "linear" and "cosine" take
the rate from its value over ``loop.lr_warmup`` updates (linearly from 1/(warmup + 1)
of it) down to ``loop.lr_final`` of it at the run's last update. The factor is a
function of the update's number alone (the policy version it starts from), so a
resumed run continues the same curve, and every rank of a torchrun job computes the
same rate. Each parameter group's own rate is kept in it as ``base_lr`` the first time
(a checkpointed optimizer carries it), so trainers with several groups or optimizers
keep their ratios.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from corun.contract.trainer import OptimizerSpec

ScheduleName = Literal["constant", "linear", "cosine"]


def lr_factor(
    schedule: ScheduleName, update: int, updates: int, *, warmup: int = 0, final: float = 0.0
) -> float:
    """The factor of the base rate for ``update`` (0-based) of ``updates`` in all."""
    if schedule == "constant":
        return 1.0
    if update < warmup:
        return (update + 1) / (warmup + 1)
    span = max(1, updates - 1 - warmup)  # the last update gets exactly ``final``
    progress = min(1.0, (update - warmup) / span)
    if schedule == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return final + (1.0 - final) * shape


def apply_factor(optimizers: Sequence[OptimizerSpec], factor: float) -> float:
    """Set every parameter group's rate to ``factor`` times its base rate; the first
    group's new rate (what ``train/lr`` reports)."""
    rates = []
    for spec in optimizers:
        for group in spec.optimizer.param_groups:
            base = group.setdefault("base_lr", group["lr"])
            group["lr"] = base * factor
            rates.append(group["lr"])
    return rates[0] if rates else 0.0
