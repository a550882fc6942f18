"""The learning rate over a run: a factor of each optimizer's own rate, per update.

``loop.lr_schedule`` = "constant" leaves the rates alone. "linear" and "cosine" take
the rate from its value over ``loop.lr_warmup`` updates (linearly from 1/(warmup + 1)
of it) down to ``loop.lr_final`` of it at the last update of the horizon
(``loop.lr_horizon``, else ``run.steps``, over ``loop.accumulate``). The factor is a
function of the update's number (the policy version it starts from) and that horizon,
so a resumed run with the same horizon continues the same curve (a checkpoint records
it; a resume under another says so in one line), and every rank of a torchrun job
computes the same rate. Each parameter group's own rate is kept in it as ``base_lr`` the first time
(a checkpointed optimizer carries it), so trainers with several groups or optimizers
keep their ratios.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from corun.base.config import Config
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


def horizon(config: Config) -> int:
    """The updates the schedule spans: ``loop.lr_horizon`` (else ``run.steps``) over
    ``loop.accumulate``; 0 for the constant schedule."""
    loop = config.loop
    if loop.lr_schedule == "constant":
        return 0
    return max(1, (loop.lr_horizon or config.run.steps) // loop.accumulate)


def moved_horizon(config: Config, saved: int, update: int) -> str | None:
    """The line a resume prints when the schedule's horizon differs from the one the
    checkpoint was saved under (``saved`` updates; 0: none recorded): the old and new
    horizon, the rate at the resumed update under each, and how to keep the first."""
    now = horizon(config)
    if not saved or not now or saved == now:
        return None
    loop = config.loop
    before, after = (
        lr_factor(loop.lr_schedule, update, n, warmup=loop.lr_warmup, final=loop.lr_final)
        for n in (saved, now)
    )
    return (
        f"the {loop.lr_schedule} learning-rate schedule now spans {now} updates, not the "
        f"{saved} it was saved under (run.steps or loop.accumulate changed): at update "
        f"{update} the rate is {after:.3g} of its base where the first curve had {before:.3g}; "
        f"loop.lr_horizon = {saved * loop.accumulate} keeps the first curve"
    )


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
