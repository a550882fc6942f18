"""Embedding: a host service trains inside its own event loop and task group
(``corun.training`` in corun/host/embed.py starts the run; this is the host's handle on it).

    async with corun.training(config) as session:
        ...                                   # the host's own tasks keep running
        await session.submit(episode)         # episodes its own agents ran
        await session.wait_for_version(3)
        session.endpoint_url                  # with [serve] enabled

corun installs no signal handlers when embedded, runs its compute on its own lane
threads (the host's loop stays free), and tears down in the documented order when
the block is left — leaving it stops the run, as an interrupt would (with its save);
``await session.finished()`` first waits for the step budget instead. Cancelling the
host's scope tears the run down the same way and re-raises; a training error
propagates out of the block.
"""

from __future__ import annotations

import anyio
import anyio.lowlevel

from corun.contract.episodes import Episode, EpisodeInbox
from corun.contract.trainer import Outcome
from corun.loop.clock import Clock
from corun.loop.teardown import RunControl


class Session:
    """A host's handle on a run it embeds."""

    def __init__(self, *, serve_only: bool = False, embedded: bool = False) -> None:
        # `corun serve`: set up, restore, serve the endpoint until stopped; no training.
        self.serve_only = serve_only
        self.embedded = embedded  # a host holds it and may submit episodes
        self.control = RunControl()
        self.inbox = EpisodeInbox()
        self.endpoint_url: str | None = None
        self.outcome: Outcome | None = None
        self._clock: Clock | None = None
        self._ready = anyio.Event()  # set up (endpoint listening), or already over
        self._over = anyio.Event()

    # ---- what the loop reports
    def bind(self, clock: Clock) -> None:
        self._clock = clock

    def ready(self) -> None:
        self._ready.set()

    def over(self, outcome: Outcome | None) -> None:
        self.outcome = outcome
        self._ready.set()
        self._over.set()

    # ---- what the host uses
    async def wait_ready(self) -> None:
        """Wait until set up (the endpoint listening), or the run is over."""
        await self._ready.wait()

    @property
    def version(self) -> int:
        """The policy version trained so far."""
        return self._clock.version if self._clock is not None else 0

    @property
    def step(self) -> int:
        return self._clock.step if self._clock is not None else 0

    async def submit(self, episode: Episode) -> None:
        """An episode the host's agents ran, for training (waits while the inbox is full)."""
        await self.inbox.put(episode)

    async def wait_for_version(self, version: int) -> None:
        while self.version < version and not self._over.is_set():
            clock = self._clock
            if clock is None:
                await anyio.lowlevel.checkpoint()  # not set up yet: the loop binds the clock first
                continue
            with anyio.move_on_after(1.0):  # the run may end without another change
                await clock.changed()

    async def finished(self) -> Outcome | None:
        """Wait for the run to end (its step budget, or a stop)."""
        await self._over.wait()
        return self.outcome

    def stop(self) -> None:
        """End the run (teardown runs; a second call skips the optional save)."""
        self.control.stop("interrupted")
