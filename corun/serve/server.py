"""The endpoint as a task with a lifetime: started in a task group of the run (or of
``corun serve``), stopped by a teardown step, before the engine it generates with.

The listening socket is bound here (so port 0 gets a free port and the URL is known
before the first request) and handed to hypercorn. ``stop`` is graceful: the server
stops accepting, in-flight requests get their complete responses (for up to
``GRACE_S``), then open connections are closed; the batcher serves until then.

A connection its client closes while idle is closed at once (``_close_at_eof``):
hypercorn 0.18 kept it, with its tasks and descriptor, until its keep-alive timeout (75 s
here) ran out, so clients that open and close connections — a pool expiring idle ones,
a client per episode — piled up sockets in CLOSE-WAIT (the soak, tests/soak.py, found
it: 100 descriptors and 200 tasks more after a minute of 32 agents).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import sniffio
from hypercorn.config import Config as HypercornConfig

from corun.base.config import ServeConfig, secret
from corun.base.errors import ConfigError
from corun.contract.episodes import EpisodeInbox
from corun.contract.policy import ServedPolicy
from corun.execution.compute import Lane
from corun.serve.app import build_app
from corun.serve.batching import Batcher
from corun.serve.capture import Recorder

GRACE_S = 5.0
KEEP_ALIVE_S = 75.0


def bearer_token(config: ServeConfig) -> str:
    """``serve.token``, or the environment variable it names (``env:NAME``)."""
    return secret(config.token, "serve.token")


class HTTPService:
    """An ASGI app on ``[serve]``'s socket as a task with a lifetime: :meth:`run` serves
    until :meth:`stop`, gracefully, with the subclass's background tasks beside it
    (:meth:`start_background`, ended by :meth:`end_background` once no request is left);
    ``lane`` is its compute lane, closed when it stops."""

    app: object

    def __init__(self, config: ServeConfig, lane: Lane) -> None:
        self.config = config
        self.lane = lane
        self.url = ""
        self._stop = anyio.Event()
        self._stopped = anyio.Event()

    async def start_background(self, tasks: anyio.abc.TaskGroup) -> None:
        """Start what serves beside the routes, in ``tasks``."""

    def end_background(self) -> None:
        """Let the background tasks end (no request is left). Not by cancelling their
        task group: on asyncio that cancel escaped into the run's own task group and
        lost its last save."""

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until :meth:`stop`; reports the URL once listening."""
        with listen(self.config) as listener:
            self.url, hypercorn = served_on(listener)
            # Shielded: the server ends through stop() (a teardown step), gracefully, even
            # when a host's cancellation tears the run down; hypercorn's own shutdown is
            # bounded by its graceful_timeout.
            try:
                with anyio.CancelScope(shield=True):
                    async with anyio.create_task_group() as tasks:
                        await self.start_background(tasks)
                        task_status.started(self.url)
                        await serve(self.app, hypercorn, self._stop.wait)
                        self.end_background()
            finally:
                self._stopped.set()

    async def stop(self) -> None:
        """Stop gracefully and wait until stopped (a teardown step)."""
        await self.stop_serving()
        self.lane.close()

    async def stop_serving(self) -> None:
        """Stop answering and wait until the server has stopped; the lane stays open
        (a subclass's last work on it comes before it closes)."""
        self._stop.set()
        await self._stopped.wait()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        """Serve for the block (outside a run: a benchmark, a test); yields the URL and
        stops gracefully on the way out, however the block ends."""
        async with anyio.create_task_group() as tasks:
            url = await tasks.start(self.run)
            try:
                yield url
            finally:
                await self.stop()


class Endpoint(HTTPService):
    """The endpoint of ``policy``; ``lane`` is its own compute lane (where a policy that
    generates in process runs: ``Trainer.served_policy(lane)``), closed when it stops."""

    def __init__(
        self, policy: ServedPolicy, config: ServeConfig, lane: Lane,
        inbox: EpisodeInbox | None = None,
    ) -> None:  # fmt: skip
        super().__init__(config, lane)
        self.batcher = Batcher(policy, config.max_batch, config.batch_wait_ms / 1000)
        self.recorder = Recorder(policy, inbox, config.episode_ttl_s)
        self.app = build_app(policy, self.batcher, self.recorder, bearer_token(config))

    async def start_background(self, tasks: anyio.abc.TaskGroup) -> None:
        tasks.start_soon(self.batcher.run)

    def end_background(self) -> None:
        self.batcher.close()  # the batcher ends by running out of requests


def listen(config: ServeConfig) -> socket.socket:
    """The listening socket of ``[serve]``'s host and port; one that cannot be had is a
    usage error naming them."""
    try:
        return socket.create_server((config.host, config.port), backlog=1024)
    except OSError as exc:
        raise ConfigError(
            f"serve: cannot listen on {config.host}:{config.port} ({exc.strerror})"
        ) from None


def served_on(listener: socket.socket) -> tuple[str, HypercornConfig]:
    """The URL of ``listener`` and hypercorn's settings to serve on it."""
    host, port = listener.getsockname()[:2]
    hypercorn = HypercornConfig()
    # hypercorn takes (and closes) the descriptor it is given: give it a copy.
    hypercorn.bind = [f"fd://{os.dup(listener.fileno())}"]
    hypercorn.graceful_timeout = GRACE_S
    # Longer than a client's idle connections live (httpx: 5 s, hypercorn's default too):
    # the client closes an idle one first, never sending a request on a connection the
    # server is closing (that request is lost: the client waits out its read timeout).
    hypercorn.keep_alive_timeout = KEEP_ALIVE_S
    hypercorn.accesslog = None
    hypercorn.errorlog = logging.getLogger("corun.serve")
    return f"http://{host}:{port}", hypercorn


async def serve(app: object, config: HypercornConfig, shutdown: object) -> None:
    # hypercorn's serve for the running event loop; with a shutdown trigger it installs
    # no signal handlers of its own (the host's, or corun's CLI, own the signals).
    if sniffio.current_async_library() == "trio":
        from hypercorn.trio import serve as trio_serve
        from hypercorn.trio.tcp_server import TCPServer as TrioTCPServer

        _close_at_eof(TrioTCPServer)
        await trio_serve(app, config, shutdown_trigger=shutdown)  # type: ignore[arg-type]
    else:
        from hypercorn.asyncio import serve as asyncio_serve
        from hypercorn.asyncio.tcp_server import TCPServer

        _close_at_eof(TCPServer)
        await asyncio_serve(app, config, shutdown_trigger=shutdown)  # type: ignore[arg-type]


def _close_at_eof(server: type[Any]) -> None:
    """Make hypercorn's connection ``server`` (asyncio's or trio's) close a connection
    once its client has closed it. Its read loop ends there, but the connection's task
    group still waited for the keep-alive timer before closing the socket; stopping the
    timer lets it close now. A request still in flight is unaffected: no timer runs
    during one, and hypercorn closes the connection after answering it. Once per class;
    a hypercorn without these internals (another version) is left as it is."""
    read_data = getattr(server, "_read_data", None)
    if read_data is None or getattr(read_data, "closes_at_eof", False):
        return

    async def read_then_stop_idle_timer(self: Any) -> None:
        await read_data(self)
        idle = getattr(self, "idle_task", None)
        if idle is not None:
            await idle.stop()

    read_then_stop_idle_timer.closes_at_eof = True  # type: ignore[attr-defined]
    server._read_data = read_then_stop_idle_timer
