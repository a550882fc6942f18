"""Concurrent requests generated together.

A request waits in a queue; the batcher takes what has arrived within ``wait_s`` of
the first one (up to ``max_batch`` replies), groups it by what must be equal within
one generation call (sampling settings, seed), and runs each group as one call of
``ServedPolicy.generate`` (prompts of any length; a policy that needs equal lengths
groups them itself). So 32 agents calling at once share a handful of forward passes
instead of taking 32 turns.

For a policy whose engine batches continuously (``ServedPolicy.continuous_batching``:
vLLM) a batch does not wait for the one before it: each runs as its own task and the
engine takes the next requests between its decode steps. For one that runs a call at
a time (the transformers engine, the calculator policy: on a lane) the requests that
arrive while a batch generates are gathered into the next batch instead — measured:
128 requests of 32 agents in 21–22 calls this way, 32–40 smaller ones otherwise. A
started generation is finished even when the request that asked for it goes away; a
failure is the error of the requests of its group only.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from corun.contract.policy import Completion, Sampling, ServedPolicy, ServeError


@dataclass
class _Request:
    prompt: list[int]
    sampling: Sampling
    seed: int | None
    n: int  # replies to the prompt, drawn together
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
        request = _Request(prompt, sampling, seed, n)
        try:
            self._send.send_nowait(request)
        except (anyio.WouldBlock, anyio.ClosedResourceError):
            message = "the endpoint is overloaded or stopping"
            raise ServeError(503, message, "server_error") from None
        await request.done.wait()
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
        sampling, seed = requests[0].sampling, requests[0].seed
        try:  # nothing a request holds may end the batcher: its error is the request's
            if seed is None:
                seed = int.from_bytes(os.urandom(7), "big")
            prompts = [r.prompt for r in requests for _ in range(r.n)]
            with anyio.CancelScope(shield=True):  # a started generation is finished
                results = await self.policy.generate(prompts, sampling, seed)
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
