"""Concurrent requests generated together.

A request waits in a queue; the batcher takes what has arrived within ``wait_s`` of
the first one (up to ``max_batch`` replies), groups it by what must be equal within
one generation call (sampling settings, seed), and runs each group as one call of
``ServedPolicy.generate`` (prompts of any length; a policy that needs equal lengths
groups them itself). So 32 agents calling at once share a handful of forward passes
instead of taking 32 turns.

For a policy whose engine batches continuously (``ServedPolicy.continuous_batching``:
every rollout engine) a batch does not wait for the one before it: each runs as its
own task and the engine takes the next requests between its decode steps. For one that
runs a call at a time (the calculator policy: on a lane) the requests that
arrive while a batch generates are gathered into the next batch instead — measured:
128 requests of 32 agents in 21–22 calls this way, 32–40 smaller ones otherwise. A
started generation is finished even when the request that asked for it goes away
(only a streamed request's sink can stop its rows: its client left); one still queued
is dropped; a failure is the error of the requests of its group only.

A streamed request (``submit`` with a sink) gets its replies' tokens as they are
sampled: a call's sink maps the call's rows back to each request's own replies.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from corun.contract.engine import Delta, TokenSink
from corun.contract.policy import Completion, Sampling, ServedPolicy, ServeError


@dataclass
class _Request:
    prompt: list[int]
    sampling: Sampling
    seed: int | None
    n: int  # replies to the prompt, drawn together
    sink: TokenSink | None = None  # streamed: its replies' tokens (reply index, delta)
    gone: bool = False  # its caller left before it was answered
    done: anyio.Event = field(default_factory=anyio.Event)
    result: list[Completion] | None = None
    error: BaseException | None = None


class Batcher:
    def __init__(self, policy: ServedPolicy, max_batch: int, wait_s: float) -> None:
        self.policy = policy
        self.max_batch = max_batch
        self.wait_s = wait_s
        send, self._receive = anyio.create_memory_object_stream[_Request](10_000)
        self._send = send
        self.batches = 0  # generation calls made (for tests and metrics)

    async def generate(
        self, prompt: list[int], sampling: Sampling, seed: int | None, n: int = 1
    ) -> list[Completion]:
        """``n`` replies to ``prompt``."""
        return await self.result(self.submit(prompt, sampling, seed, n))

    def submit(
        self, prompt: list[int], sampling: Sampling, seed: int | None, n: int = 1,
        sink: TokenSink | None = None,
    ) -> _Request:  # fmt: skip
        """Queue ``n`` replies to ``prompt`` (a 503 when the queue cannot take them);
        with ``sink``, their tokens stream to it as they are sampled."""
        request = _Request(prompt, sampling, seed, n, sink)
        try:
            self._send.send_nowait(request)
        except (anyio.WouldBlock, anyio.ClosedResourceError):
            message = "the endpoint is overloaded or stopping"
            raise ServeError(503, message, "server_error") from None
        return request

    async def result(self, request: _Request) -> list[Completion]:
        """A submitted request's replies; cancelled while it is still queued, it is
        dropped."""
        try:
            await request.done.wait()
        finally:
            request.gone = True
        if request.error is not None:
            raise ServeError(500, f"generation failed: {request.error}", "server_error")
        assert request.result is not None
        return request.result

    def close(self) -> None:
        """Take no more requests: :meth:`run` returns once those queued are answered."""
        self._send.close()

    async def run(self) -> None:
        """Serve batches until cancelled (generations already started are finished);
        requests left waiting get an error."""
        try:
            async with anyio.create_task_group() as batches:
                async for first in self._receive:
                    batch = [first]
                    try:
                        await self._gather(batch)
                    finally:  # also when cancelled: what was gathered is answered
                        for group in _groups(batch):
                            batches.start_soon(self._run_group, group)
                    if not self.policy.continuous_batching:  # the next batch gathers meanwhile
                        for request in batch:
                            await request.done.wait()
        finally:
            self._send.close()
            _refuse_waiting(self._receive)
            self._receive.close()

    async def _gather(self, batch: list[_Request]) -> None:
        """Add what arrives within ``wait_s``, up to ``max_batch`` replies."""
        rows = batch[0].n
        while rows < self.max_batch:  # what is queued already (arrived during a call)
            try:
                batch.append(self._receive.receive_nowait())
            except anyio.WouldBlock:
                break
            rows += batch[-1].n
        with anyio.move_on_after(self.wait_s):
            while rows < self.max_batch:
                batch.append(await self._receive.receive())
                rows += batch[-1].n

    async def _run_group(self, requests: list[_Request]) -> None:
        for request in requests:
            if request.gone:  # left while queued: not generated
                request.error = RuntimeError("its caller left")
                request.done.set()
        requests = [r for r in requests if not r.gone]
        if not requests:
            return
        sampling, seed = requests[0].sampling, requests[0].seed
        try:  # nothing a request holds may end the batcher: its error is the request's
            if seed is None:
                seed = int.from_bytes(os.urandom(7), "big")
            prompts = [r.prompt for r in requests for _ in range(r.n)]
            sink = _call_sink(requests)
            with anyio.CancelScope(shield=True):  # a started generation is finished
                if sink is None:  # (a policy need not take a sink to serve whole replies)
                    results = await self.policy.generate(prompts, sampling, seed)
                else:
                    results = await self.policy.generate(prompts, sampling, seed, sink)
            if len(results) != len(prompts):
                raise RuntimeError(f"{len(results)} replies to {len(prompts)} prompts")
        except Exception as exc:
            for request in requests:
                request.error = exc
                request.done.set()
            return
        self.batches += 1
        for request in requests:
            request.result, results = results[: request.n], results[request.n :]
            request.done.set()


def _call_sink(requests: list[_Request]) -> TokenSink | None:
    """One call's sink: its rows to the sinks of the requests they belong to (None when
    no request streams)."""
    if all(r.sink is None for r in requests):
        return None
    rows = [(r, k) for r in requests for k in range(r.n)]

    def sink(row: int, delta: Delta) -> bool:
        request, k = rows[row]
        return True if request.sink is None else request.sink(k, delta)

    return sink


def _groups(batch: list[_Request]) -> list[list[_Request]]:
    groups: dict[tuple[Any, ...], list[_Request]] = defaultdict(list)
    for request in batch:
        groups[(request.sampling, request.seed)].append(request)
    return list(groups.values())


def _refuse_waiting(receive: MemoryObjectReceiveStream[_Request]) -> None:
    """Requests still queued when the batcher ends get an error instead of a hang."""
    while True:
        try:
            request = receive.receive_nowait()
        except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
            return
        request.error = RuntimeError("the endpoint stopped")
        request.done.set()
