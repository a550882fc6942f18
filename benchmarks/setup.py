"""A trainer set up in a benchmark's own process as a run sets it up (through the
registry), and torn down, its teardown steps newest first, when the caller's exit
stack closes."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

from corun.base.config import Config
from corun.contract.registry import resolve_trainer
from corun.contract.trainer import SetupContext
from corun.execution.compute import Lane


async def set_up(config: Config, stack: AsyncExitStack, *, train_lane: bool = False) -> Any:
    """``config``'s trainer, set up until ``stack`` closes; with ``train_lane``, its
    blocking hooks get a train lane of their own, as in a run."""
    trainer = resolve_trainer(config.trainer.kind)(config)
    ctx = SetupContext(config)
    if train_lane:
        ctx.lane = Lane("train")
        stack.callback(ctx.lane.close)
    stack.push_async_callback(teardown, ctx)
    await call(trainer.setup, ctx)
    return trainer


async def teardown(ctx: SetupContext) -> None:
    for _, step in reversed(ctx.teardowns):
        await call(step)


async def call(hook: Callable[..., Any], *args: Any) -> None:
    """A hook, sync or async, on this thread (a benchmark's set-up, not a run's)."""
    if inspect.isawaitable(result := hook(*args)):
        await result
