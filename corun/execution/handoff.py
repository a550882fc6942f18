"""Items handed from any thread to a task on the event loop, without blocking the thread.

A rollout engine samples on its lane's thread while the endpoint's task waits on the
loop for the tokens: :class:`Handoff` is that queue. ``put`` never blocks and never
waits for the loop (a lane's decode step must not), and it wakes the waiting task with
one callback scheduled on the loop (asyncio's ``call_soon_threadsafe``, trio's
``run_sync_soon``), only when the task is waiting: items put while it works are taken
together at its next ``take``. Called on the loop's own thread (inline compute, an
engine behind I/O) it wakes the task directly.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import anyio
import sniffio

T = TypeVar("T")


class Handoff(Generic[T]):
    """Created on the event loop whose one task takes the items."""

    def __init__(self) -> None:
        self._items: list[T] = []
        self._lock = threading.Lock()
        self._closed = False
        self._event: anyio.Event | None = None  # set while the task waits
        self._loop_thread = threading.get_ident()
        self._resume: Callable[[Callable[[], Any]], Any]
        if sniffio.current_async_library() == "trio":
            import trio

            self._resume = trio.lowlevel.current_trio_token().run_sync_soon
        else:
            self._resume = asyncio.get_running_loop().call_soon_threadsafe

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, item: T) -> bool:
        """Add ``item`` (from any thread); False, and nothing added, once closed."""
        with self._lock:
            if self._closed:
                return False
            self._items.append(item)
            event, self._event = self._event, None
        if event is not None:
            self._wake(event)
        return True

    def close(self) -> None:
        """Take no more items; a waiting ``take`` returns what is left."""
        with self._lock:
            self._closed = True
            event, self._event = self._event, None
        if event is not None:
            self._wake(event)

    async def take(self) -> list[T]:
        """The items put since the last take, waiting for one; [] once closed and empty."""
        while True:
            with self._lock:
                if self._items or self._closed:
                    items, self._items = self._items, []
                    return items
                event = self._event = anyio.Event()
            await event.wait()

    def _wake(self, event: anyio.Event) -> None:
        if threading.get_ident() == self._loop_thread:
            event.set()
            return
        try:
            self._resume(event.set)
        except RuntimeError:  # the loop is gone: nobody waits
            pass
