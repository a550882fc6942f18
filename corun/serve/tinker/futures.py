"""Futures and order: what a Tinker client polls, and each model's requests run in the
order the client numbered them.

A request is answered at once with a request id; its result (a JSON body, protobuf
bytes, or an error with its category) is collected by long-polling ``retrieve_future``.
Results wait for collection in a bounded table (the oldest finished dropped first).

A model's requests carry ``seq_id`` 1, 2, ...: :class:`Turns` runs them in that order
whatever order they arrive in, answers a retried request (the same ``seq_id`` and kind)
with its first request id, and refuses a ``seq_id`` taken by another kind of request,
one that already ran long ago, or one beyond what the queue holds.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import msgspec

from corun.contract.training_api import RequestError

Category = Literal["user", "server"]
JSON = "application/json"


@dataclass(frozen=True)
class Reply:
    body: bytes
    media: str = JSON

    @staticmethod
    def json(value: Any) -> Reply:
        return Reply(msgspec.json.encode(value))

    @staticmethod
    def error(message: str, category: Category) -> Reply:
        return Reply.json({"error": message, "category": category})


class Future:
    """One request's result, once set."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.reply: Reply | None = None
        self._done = anyio.Event()

    @property
    def done(self) -> bool:
        return self.reply is not None

    def set(self, reply: Reply) -> None:
        if self.reply is None:
            self.reply = reply
            self._done.set()

    async def wait(self, hold_s: float) -> Reply | None:
        """The reply, waiting for it up to ``hold_s`` (None: not ready yet)."""
        with anyio.move_on_after(hold_s):
            await self._done.wait()
        return self.reply


class Futures:
    """The futures of the server, finished ones kept up to ``keep``."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._futures: OrderedDict[str, Future] = OrderedDict()
        self._ids = itertools.count(1)

    def create(self) -> Future:
        request_id = f"req-{next(self._ids)}"
        future = self._futures[request_id] = Future(request_id)
        self._prune()
        return future

    def get(self, request_id: str) -> Future | None:
        return self._futures.get(request_id)

    def _prune(self) -> None:
        finished = [rid for rid, f in self._futures.items() if f.done]
        for request_id in finished[: max(0, len(self._futures) - self.keep)]:
            del self._futures[request_id]

    def fail_pending(self, message: str) -> int:
        """Fail every unfinished future (the server is stopping); returns how many."""
        pending = [f for f in self._futures.values() if not f.done]
        for future in pending:
            future.set(Reply.error(message, "server"))
        return len(pending)


Job = Callable[[], Awaitable[Reply]]


class Turns:
    """One model's requests, run one at a time in ``seq_id`` order by :meth:`run`."""

    def __init__(self, limit: int, first: int = 1) -> None:
        self.limit = limit
        self.next = first
        self._waiting: dict[int, tuple[Future, Job]] = {}
        self._seen: dict[int, tuple[Future, str]] = {}  # recent: retries get their reply
        self._arrived = anyio.Event()
        self._closed = False

    def submit(self, seq_id: int | None, futures: Futures, job: Job, kind: str) -> Future:
        """The future of request ``seq_id`` (its first one, if retried: the same ``kind``
        of request; another kind under a number taken is refused)."""
        if seq_id is None:
            raise RequestError("seq_id: missing (a model's requests are numbered)")
        if seq_id in self._seen:
            first, taken_by = self._seen[seq_id]
            if taken_by == kind:
                return first
        future = futures.create()
        if seq_id in self._seen:
            future.set(Reply.error(
                f"seq_id {seq_id}: the model ran its {self._seen[seq_id][1]} request under this "
                "number; each request takes the next one", "user",
            ))  # fmt: skip
            return future
        if seq_id < self.next:
            future.set(Reply.error(
                f"seq_id {seq_id}: this model's requests up to {self.next - 1} have run; "
                "requests run in the order of their seq_id", "user",
            ))  # fmt: skip
            return future
        if seq_id >= self.next + self.limit:
            future.set(Reply.error(
                f"seq_id {seq_id}: the model waits for seq_id {self.next}, and holds at most "
                f"{self.limit} requests (serve.tinker_queue)", "user",
            ))  # fmt: skip
            return future
        if self._closed:
            future.set(Reply.error("the model's session has finished", "user"))
            return future
        self._seen[seq_id] = (future, kind)
        self._waiting[seq_id] = (future, job)
        self._arrived.set()
        return future

    def close(self) -> None:
        """Run what is queued, then end :meth:`run`."""
        self._closed = True
        self._arrived.set()

    def abandon(self) -> None:
        """Drop what is queued (its futures failed already) and end :meth:`run` once the
        request running now completes."""
        self._waiting.clear()
        self.close()

    async def run(self) -> None:
        while True:
            if self.next not in self._waiting:
                if self._closed:
                    return
                self._arrived = anyio.Event()
                await self._arrived.wait()
                continue
            future, job = self._waiting.pop(self.next)
            self._forget(self.next - self.limit)
            self.next += 1
            future.set(await answer(job))

    def _forget(self, seq_id: int) -> None:
        self._seen.pop(seq_id, None)  # old enough that no client retries it


async def answer(job: Job) -> Reply:
    """``job``'s reply; its refusal as the client's error, anything else as the server's."""
    try:
        return await job()
    except RequestError as exc:
        return Reply.error(str(exc), "user")
    except Exception as exc:  # the model failed: the server's error, and it goes on serving
        return Reply.error(f"{type(exc).__name__}: {exc}", "server")
