"""The Tinker server as a task with a lifetime, like the OpenAI-compatible endpoint
(corun/serve/server.py): started in the run's task group by ``corun serve CONFIG
serve.tinker=true``, stopped by the teardown step ``endpoint``.

Stopping, in order: every unfinished future fails with "the server is stopping" (so a
client's held poll answers at once), the server stops listening and lets in-flight
requests finish, the models' queued work is cancelled (a call already running on the
lane completes), each model still open is saved as ``tinker://<model_id>/weights/last``
(optional: a second signal skips it), and the sampling engines shut down.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import anyio
import anyio.abc

from corun.base.config import ServeConfig
from corun.contract.training_api import TrainingBackend
from corun.execution.compute import Lane
from corun.serve.server import bearer_token, listen, serve, served_on
from corun.serve.tinker.app import build_app
from corun.serve.tinker.service import TinkerService, tinker_path, write_record

LAST = "last"  # the name each open model is saved under when the server stops
STOPPING = "the server is stopping"


class TinkerServer:
    """The Tinker API over ``backend``; saved states under ``<run_dir>/tinker``."""

    def __init__(
        self, backend: TrainingBackend, config: ServeConfig, lane: Lane, run_dir: Path
    ) -> None:  # fmt: skip
        self.config = config
        self.lane = lane
        self.service = TinkerService(backend, config, lane, run_dir / "tinker")
        self.app = build_app(self.service, bearer_token(config))
        self.url = ""
        self.save_on_stop = True
        self._stop = anyio.Event()
        self._stopped = anyio.Event()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until :meth:`stop`; reports the URL once listening."""
        with listen(self.config) as listener:
            self.url, hypercorn = served_on(listener)
            try:
                with anyio.CancelScope(shield=True):  # ends through stop(), as the endpoint
                    async with anyio.create_task_group() as tasks:
                        await tasks.start(self.service.run)
                        task_status.started(self.url)
                        await serve(self.app, hypercorn, self._stop.wait)
                        tasks.cancel_scope.cancel()
            finally:
                self._stopped.set()

    async def stop(self) -> None:
        """Stop as the module says and wait until stopped (a teardown step)."""
        self.service.futures.fail_pending(STOPPING)
        self._stop.set()
        await self._stopped.wait()
        try:
            if self.save_on_stop:
                await self._save_open_models()
        finally:
            await self.service.backend.close()
            self.lane.close()

    async def _save_open_models(self) -> None:
        for entry in list(self.service.models.values()):
            directory = self.service.directory(entry.model_id, "weights", LAST)
            await self.lane.run(partial(entry.model.save, directory, optimizer=True))
            write_record(directory, entry.base_model, entry.shape)
            print(f"corun: saved {tinker_path(entry.model_id, 'weights', LAST)}", file=sys.stderr)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        """Serve for the block (outside a run: a test, a benchmark); yields the URL and
        stops on the way out, however the block ends."""
        async with anyio.create_task_group() as tasks:
            url = await tasks.start(self.run)
            try:
                yield url
            finally:
                await self.stop()
