"""Streamed replies: tokens sent as server-sent events while they are generated.

A streamed request is submitted to the batcher with a sink (:class:`TokenFeed`): the
engine hands each decode step's tokens to it on its own thread
(corun/contract/engine.py's streaming rules), a :class:`~corun.execution.handoff.Handoff`
wakes the request's task on the loop, and the route turns them into chunks at once.
Engines that cannot stream deliver each reply whole at its end, through the same path.

What of a reply's text may be sent before the reply is complete (:func:`releasable`),
so that the deltas joined are exactly the content the whole reply gets:

- leading whitespace is dropped (as a chat reply's content drops it), trailing
  whitespace and an incomplete character are held back until text follows;
- stop strings: text from the first stop string on is never sent, and a tail that
  could be the start of one is held back until it cannot be; once a stop string is
  complete the reply is done and its row stops generating;
- tools offered: text from the policy's tool-call marker (``<tool_call>``) on is held
  back, and a tail that could start it; the reply's tool calls are parsed from the
  whole reply when it ends and sent as tool-call deltas then, with any content the
  marker held back. A policy with no marker (any reply may be a call) sends nothing
  before the end when tools are offered.

A client that disconnects mid-stream closes its feed: the sink then declines its rows,
so the engine stops generating them (vLLM in process aborts the requests, the
transformers engine masks the rows; the call's other rows go on), and a request still
queued is dropped.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from corun.agents.chat import Decode
from corun.contract.engine import Delta
from corun.contract.policy import Completion, ServeError
from corun.execution.handoff import Handoff
from corun.serve.batching import Batcher

Emit = Callable[[dict[str, Any]], Awaitable[None]]
# Benchmark-only (benchmarks/streaming.py's baseline): generate the whole reply, then
# send its chunks (the role's, then a token each), as the endpoint did before it streamed.
WHOLE_REPLY = False


def releasable(
    text: str, stops: Sequence[str], marker: str | None, *, lstrip: bool
) -> tuple[str, bool]:
    """The part of a reply's ``text`` so far that may be sent, and whether a stop string
    ended it. ``marker``: the tool-call marker when tools are offered (None: they are
    not); ``lstrip``: the content drops leading whitespace (a chat reply's)."""
    found = [text.find(stop) for stop in stops if stop in text]
    ended = bool(found)
    text = text[: min(found)] if found else _hold_back(text, stops)
    if marker is not None:
        at = text.find(marker) if marker else 0
        text = text[:at] if at >= 0 else _hold_back(text, [marker])
    text = text.rstrip("\ufffd").rstrip()  # a character not yet whole; whitespace
    return (text.lstrip() if lstrip else text), ended


def _hold_back(text: str, patterns: Sequence[str]) -> str:
    """``text`` without its longest tail that could begin one of ``patterns``."""
    keep = len(text)
    for pattern in patterns:
        for n in range(min(len(pattern) - 1, len(text)), 0, -1):
            if text.endswith(pattern[:n]):
                keep = min(keep, len(text) - n)
                break
    return text[:keep]


class ReplyText:
    """One reply's ids as they arrive and the text sent of it so far."""

    def __init__(
        self, decode: Decode, stops: Sequence[str], marker: str | None, *, lstrip: bool
    ) -> None:
        self.decode, self.stops, self.marker, self.lstrip = decode, stops, marker, lstrip
        self.ids: list[int] = []
        self.sent = ""  # the text sent
        self.tokens = 0  # tokens whose log-probs were sent
        self.ended = False  # a stop string ended it: nothing more is sent

    def add(self, ids: Sequence[int]) -> str:
        """The text newly releasable once ``ids`` follow."""
        self.ids += ids
        safe, self.ended = releasable(self.decode(self.ids), self.stops, self.marker,
                                      lstrip=self.lstrip)  # fmt: skip
        if not safe.startswith(self.sent):  # a decode that changed earlier text: wait
            return ""
        piece, self.sent = safe[len(self.sent) :], safe
        return piece

    def rest(self, final: str) -> str:
        """What is still owed of the reply's ``final`` text."""
        return final[len(self.sent) :] if final.startswith(self.sent) else ""


class TokenFeed:
    """A streamed request's tokens, from the engine's thread to the route's task; its
    sink declines a reply once :meth:`end` marks it, or once the feed is closed (the
    client left)."""

    def __init__(self) -> None:
        self._handoff: Handoff[tuple[int, Delta]] = Handoff()
        self._ended: set[int] = set()
        self.whole = WHOLE_REPLY
        self.sink: Callable[[int, Delta], bool] | None = None if self.whole else self._sink

    def _sink(self, reply: int, delta: Delta) -> bool:
        """On the engine's thread: hand ``delta`` over; False: not wanted any more."""
        return reply not in self._ended and self._handoff.put((reply, delta))

    def end(self, reply: int) -> None:
        """Reply ``reply`` is complete (a stop string): the engine may stop it."""
        self._ended.add(reply)

    def close(self) -> None:
        self._handoff.close()

    async def run(
        self, batcher: Batcher, request: Any, each: Callable[[int, Delta], Awaitable[None]]
    ) -> list[Completion]:
        """``each(reply, delta)`` as tokens arrive, then the request's replies (a
        :class:`ServeError` if it failed). Cancelled, the feed is closed."""
        outcome: list[Completion] = []
        failed: list[ServeError] = []

        async def wait() -> None:
            try:
                outcome.extend(await batcher.result(request))
            except ServeError as exc:
                failed.append(exc)
            finally:
                self._handoff.close()  # what was put before stays to be taken

        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(wait)
                while items := await self._handoff.take():
                    for reply, delta in _joined(items):
                        await each(reply, delta)
        finally:
            self._handoff.close()
        if failed:
            raise failed[0]
        for reply, done in enumerate(outcome if self.whole else ()):  # the baseline's
            for i in range(len(done.ids)):
                top = None if done.top is None else done.top[i : i + 1]
                await each(reply, Delta(done.ids[i : i + 1], done.logprobs[i : i + 1],
                                        done.versions[i : i + 1], top))  # fmt: skip
        return outcome


def _joined(items: Sequence[tuple[int, Delta]]) -> list[tuple[int, Delta]]:
    """The deltas taken together, one per reply (in the order replies first came): when
    the loop falls behind the engine, it sends fewer, larger chunks instead of
    falling further behind (a chunk and a decode of the reply per token)."""
    parts: dict[int, list[Delta]] = {}
    for reply, delta in items:
        parts.setdefault(reply, []).append(delta)
    return [(reply, _join(deltas)) for reply, deltas in parts.items()]


def _join(deltas: list[Delta]) -> Delta:
    if len(deltas) == 1:
        return deltas[0]
    tops = [d.top for d in deltas]
    return Delta(
        [i for d in deltas for i in d.ids], [x for d in deltas for x in d.logprobs],
        [v for d in deltas for v in d.versions],
        None if any(t is None for t in tops) else [step for t in tops if t for step in t],
    )  # fmt: skip


class _Left(Exception):
    """The client went away while the stream was being written."""


class EventStream(Response):
    """A server-sent event stream written by ``run(emit)`` as it goes, then ``[DONE]``.
    A client that disconnects cancels ``run`` and ``left`` is called; a failure after
    the first byte is sent as an error event (the status line is gone by then)."""

    media_type = "text/event-stream"

    def __init__(self, run: Callable[[Emit], Awaitable[None]], left: Callable[[], None]) -> None:
        super().__init__(media_type=self.media_type)
        # No content-length: the body is written as it comes.
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache")]  # fmt: skip
        self._run, self._left = run, left

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})

        async def emit(event: dict[str, Any]) -> None:
            await _write(send, b"data: " + msgspec.json.encode(event) + b"\n\n", more=True)

        gone = False
        async with anyio.create_task_group() as tasks:

            async def watch() -> None:
                nonlocal gone
                while (await receive())["type"] != "http.disconnect":
                    pass
                gone = True
                tasks.cancel_scope.cancel()

            tasks.start_soon(watch)
            try:
                await self._run(emit)
            except ServeError as exc:
                await emit(exc.body())
            except _Left:
                gone = True
            tasks.cancel_scope.cancel()
        if gone:
            self._left()
            return
        try:
            await _write(send, b"data: [DONE]\n\n", more=False)
        except _Left:
            self._left()


async def _write(send: Send, body: bytes, *, more: bool) -> None:
    try:
        await send({"type": "http.response.body", "body": body, "more_body": more})
    except OSError as exc:  # the connection is gone
        raise _Left() from exc
