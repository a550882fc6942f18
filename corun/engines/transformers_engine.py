"""The in-process rollout engine of a Hugging Face policy (``engine = "local"``):
``transformers`` forward passes with a KV cache (decode.py) behind the async engine
interface of corun/contract/engine.py.

The engine samples from its own copy of the weights, which only a weight update
changes. Its compute runs on one lane: the train lane at concurrency 1 (rollouts and
updates alternate there, as a hand-written loop would run them), its own otherwise,
so generation overlaps training. Calls on the lane run in order, so an update queued
behind running generations lets them finish on their weights ("drain"); with
``interrupt`` an update is picked up between two decode steps instead (a partial
rollout), and the sync does not wait for generations at all.

Its fingerprint (corun/engines/fingerprint.py) is of what a generation started now
would use: its model's state, or, with ``interrupt``, the weights published and not yet
picked up (the engine's own snapshot of them, which is what it will load).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping, Sequence

import anyio
import torch
from torch import Tensor

from corun.contract.engine import EngineError, Generation, Sampling
from corun.engines import decode
from corun.engines.fingerprint import weights_fingerprint
from corun.execution.compute import Lane, blocking_io


class TransformersEngine:
    """Samples from its own copy of ``policy.model``, the model it decodes (it is a
    :class:`decode.CausalLM` itself)."""

    def __init__(
        self, policy: decode.CausalLM, pad_id: int, lane: Lane, *, owns_lane: bool,
        interrupt: bool,
    ) -> None:  # fmt: skip
        self.model = copy.deepcopy(policy.model).eval()
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        self.pad_id = pad_id
        self.lane = lane
        self._owns_lane = owns_lane
        self._interrupt = interrupt
        self._version = 0
        self._lock = threading.Lock()
        self._pending: tuple[int, dict[str, Tensor]] | None = None
        self._loading: tuple[int, dict[str, Tensor]] | None = None  # taken, being loaded
        self._resumed = anyio.Event()
        self._resumed.set()
        self._closed = False

    @property
    def version(self) -> int:
        return self._version

    @property
    def interrupts(self) -> bool:
        return self._interrupt

    async def generate(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int
    ) -> list[Generation]:
        await self._resumed.wait()
        if self._closed:
            raise EngineError("the transformers engine is shut down")
        return await self.lane.run(self._generate, list(prompts), sampling, seed)

    def _generate(
        self, prompts: list[list[int]], sampling: Sampling, seed: int
    ) -> list[Generation]:
        generator = torch.Generator().manual_seed(seed)
        return decode.generate(
            self, prompts, sampling, generator, self.pad_id, self._current_weights
        )

    def _current_weights(self) -> int:
        """Between decode steps (on the lane): take weights published since, if any."""
        with self._lock:
            pending, self._pending = self._pending, None
            self._loading = pending
        if pending is not None:
            try:
                self._load(*pending)
            finally:
                with self._lock:
                    self._loading = None
        return self._version

    def _load(self, version: int, state: Mapping[str, Tensor]) -> None:
        with torch.no_grad():
            self.model.load_state_dict(state)
        self._version = version

    async def update_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        if self._interrupt:
            # A snapshot: the trainer goes on changing its weights after this returns.
            snapshot = _snapshot(state)
            with self._lock:
                self._pending = (version, snapshot)
            return
        await self.lane.run(self._load, version, state)

    async def fingerprint(self) -> str:
        # In a worker thread (inline in inline mode): it only reads, and a large model
        # takes a moment.
        return await blocking_io(self.lane.mode, self._fingerprint)

    def _fingerprint(self) -> str:
        with self._lock:
            published = self._pending or self._loading
        if published is not None:  # what the next decode step loads
            return weights_fingerprint(published[1].values())
        # No update is in flight (syncs do not overlap): the model stays as it is.
        return weights_fingerprint(self.model.state_dict().values())

    async def pause(self) -> None:
        self._resumed = anyio.Event()
        await self.lane.run(lambda: None)  # generations queued before the pause finish

    async def resume(self) -> None:
        self._resumed.set()

    async def health(self) -> bool:
        return not self._closed

    async def shutdown(self) -> None:
        self._closed = True
        self._resumed.set()
        if self._owns_lane:
            self.lane.close()


def _snapshot(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A copy of ``state`` in which tensors that shared storage still share it (tied
    weights stay one tensor, as in the model)."""
    copies: dict[tuple[object, ...], Tensor] = {}
    out = {}
    for key, value in state.items():
        value = value.detach()
        ident = (value.device, value.dtype, value.data_ptr(), value.shape, value.stride())
        if ident not in copies:
            copies[ident] = value.clone()
        out[key] = copies[ident]
    return out
