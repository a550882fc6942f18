"""Checkpoint writes in the background: the step loop snapshots the trainer's state
and goes on training while the files are written; teardown drains what is pending.

A failed write fails the run: the writer records the error and stops the run
through its ``RunControl``, and the session raises it after teardown.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from corun import checkpoint
from corun.events import EventLog, Trace
from corun.teardown import RunControl

BlockingCall = Callable[..., Awaitable[Any]]


class CheckpointWriter:
    def __init__(
        self, run_dir: Path, keep: int, events: EventLog, trace: Trace, control: RunControl,
        blocking: BlockingCall,
    ) -> None:  # fmt: skip
        self.run_dir = run_dir
        self.keep = keep
        self.events = events
        self.trace = trace
        self.control = control
        self.blocking = blocking  # file I/O off the loop (or inline, in inline mode)
        self.error: BaseException | None = None
        self._pending = 0
        self._done = anyio.Event()
        self._tasks: anyio.abc.TaskGroup | None = None

    def attach(self, tasks: anyio.abc.TaskGroup) -> None:
        """The task group the writes run in: outside the run's cancel scope, so an
        interrupt never cuts a write short (the rename makes each one atomic anyway)."""
        self._tasks = tasks

    def submit(self, tensors: Any, state: checkpoint.TrainerState) -> None:
        assert self._tasks is not None, "attach() the writer to a task group first"
        self._pending += 1
        self._done = anyio.Event()
        self._tasks.start_soon(self._write, tensors, state)

    async def _write(self, tensors: Any, state: checkpoint.TrainerState) -> None:
        try:
            with self.trace.span("write", "checkpoint", step=state.step):
                path = await self.blocking(
                    checkpoint.write, self.run_dir, state.step, tensors, state
                )
                await self.blocking(checkpoint.prune, self.run_dir, self.keep)
            self.events.emit("checkpoint_written", state.step, path=str(path))
        except Exception as exc:  # a failed save fails the run: stop it, surface the error
            self.error = self.error or exc
            self.control.stop("error")
        finally:
            self._pending -= 1
            if self._pending == 0:
                self._done.set()

    async def drain(self) -> None:
        """Wait for every pending write (a teardown step)."""
        if self._pending:
            await self._done.wait()
