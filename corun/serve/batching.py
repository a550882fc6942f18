"""Concurrent requests generated together.

A request waits in a queue; the batcher takes what has arrived within ``wait_s`` of
the first one (up to ``max_batch``), groups it by what must be equal within one
generation call (prompt length, sampling settings, seed), and runs each group as one
call of ``ServedPolicy.generate`` on the endpoint's compute lane. So 32 agents calling
at once share a handful of forward passes instead of taking 32 turns.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import torch

from corun.contract.policy import Completion, Sampling, ServedPolicy, ServeError
from corun.execution.compute import Lane


@dataclass
class _Request:
    prompt: list[int]
    sampling: Sampling
    seed: int | None
    done: anyio.Event = field(default_factory=anyio.Event)
    result: Completion | None = None
    error: BaseException | None = None


class Batcher:
    def __init__(self, policy: ServedPolicy, lane: Lane, max_batch: int, wait_s: float) -> None:
        self.policy = policy
        self.lane = lane
        self.max_batch = max_batch
        self.wait_s = wait_s
        send, self._receive = anyio.create_memory_object_stream[_Request](10_000)
        self._send = send
        self.batches = 0  # generation calls made (for tests and metrics)

    async def generate(self, prompt: list[int], sampling: Sampling, seed: int | None) -> Completion:
        request = _Request(prompt, sampling, seed)
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

    async def run(self) -> None:
        """Serve batches until cancelled; requests left waiting get an error."""
        try:
            async with self._receive:
                async for first in self._receive:
                    batch = [first]
                    with anyio.move_on_after(self.wait_s):
                        while len(batch) < self.max_batch:
                            batch.append(await self._receive.receive())
                    await self._run_batch(batch)
        finally:
            self._send.close()

    async def _run_batch(self, batch: list[_Request]) -> None:
        groups: dict[tuple[Any, ...], list[_Request]] = defaultdict(list)
        for request in batch:
            groups[(len(request.prompt), request.sampling, request.seed)].append(request)
        for (_, sampling, seed), requests in groups.items():
            try:  # nothing a request holds may end the batcher: its error is the request's
                generator = torch.Generator().manual_seed(
                    seed if seed is not None else int.from_bytes(os.urandom(7), "big")
                )
                prompts = [r.prompt for r in requests]
                call = _call(self.policy.generate, prompts, sampling, generator)
                with anyio.CancelScope(shield=True):  # a started generation is finished
                    results = await self.lane.run(call)
            except Exception as exc:
                for request in requests:
                    request.error = exc
                    request.done.set()
                continue
            self.batches += 1
            for request, result in zip(requests, results, strict=True):
                request.result = result
                request.done.set()


def _call(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    return lambda: fn(*args)
