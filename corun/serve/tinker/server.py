"""The Tinker server as a task with a lifetime, like the OpenAI-compatible endpoint
(corun/serve/server.py): started in the run's task group by ``corun serve CONFIG
serve.tinker=true``, stopped by the teardown step ``endpoint``.

Stopping, in order: every unfinished future fails with "the server is stopping" (so a
client's held poll answers at once), the server stops listening and lets in-flight
requests finish, the models' queued work is cancelled (a call already running on the
lane completes), each model still open is saved as ``tinker://<model_id>/weights/last``
(adapters and their optimizer state: small; a second signal does not skip it, a third
ends the process at once), and the sampling engines shut down.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import anyio
import anyio.abc

from corun.base.config import ServeConfig
from corun.contract.training_api import TrainingBackend, TrainingModel
from corun.execution.compute import Lane
from corun.serve.server import HTTPService, bearer_token
from corun.serve.tinker.app import build_app
from corun.serve.tinker.service import TinkerService, tinker_path, write_record

LAST = "last"  # the name each open model is saved under when the server stops
STOPPING = "the server is stopping"


class TinkerServer(HTTPService):
    """The Tinker API over ``backend``; saved states under ``<run_dir>/tinker``."""

    def __init__(
        self, backend: TrainingBackend, config: ServeConfig, lane: Lane, run_dir: Path
    ) -> None:  # fmt: skip
        super().__init__(config, lane)
        self.service = TinkerService(backend, config, lane, run_dir / "tinker")
        self.app = build_app(self.service, bearer_token(config))

    async def start_background(self, tasks: anyio.abc.TaskGroup) -> None:
        await tasks.start(self.service.run)

    def end_background(self) -> None:
        self.service.close()  # queued work dropped; what runs completes

    async def stop(self) -> None:
        """Stop as the module says and wait until stopped (a teardown step)."""
        self.service.futures.fail_pending(STOPPING)
        try:
            await self.stop_serving()
            await self._save_open_models()  # on the lane: before it closes
        finally:
            try:
                await self.service.backend.close()
            finally:
                self.lane.close()

    async def _save_open_models(self) -> None:
        for entry in list(self.service.models.values()):
            directory = self.service.directory(entry.model_id, "weights", LAST)
            await self.service.on_model(entry, partial(_save_whole, directory))
            write_record(directory, entry.base_model, entry.shape)
            print(f"corun: saved {tinker_path(entry.model_id, 'weights', LAST)}", file=sys.stderr)


def _save_whole(directory: Path, model: TrainingModel) -> None:
    model.save(directory, optimizer=True)
