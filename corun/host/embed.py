"""``corun.training(config)``: a run inside the caller's task group (corun/loop/session.py
says what the host gets and what leaving the block does)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

from corun.base.config import Config
from corun.contract.registry import resolve_trainer
from corun.contract.trainer import Trainer
from corun.execution.compute import blocking_io
from corun.host.runs import run
from corun.loop.session import Session


@asynccontextmanager
async def training(config: Config, trainer: Trainer[Any] | None = None) -> AsyncIterator[Session]:
    """Train ``config`` (or ``trainer``) in the caller's task group; see the module doc."""
    session = Session(embedded=True)
    if trainer is None:
        # Importing the trainer's modules takes 10-30 ms (more from a cold disk cache):
        # in a worker thread, so the host's loop keeps running (max lag 29 → 4 ms).
        trainer_class = await blocking_io(config.loop.compute, resolve_trainer, config.trainer.kind)
        trainer = trainer_class(config)
    async with anyio.create_task_group() as tasks:

        async def train() -> None:
            try:
                await run(trainer, config, session=session)
            finally:
                session._ready.set()

        tasks.start_soon(train)
        await session.wait_ready()
        # Leaving the block stops the run, as an interrupt would; an error or a
        # cancellation of the host instead cancels it, through the task group.
        yield session
        session.stop()
