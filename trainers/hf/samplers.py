"""Sampling for the training API (trainers/hf/tinker.py): rollout engines on the base
policy, started on first use and kept until the server stops, that serve the base
weights or one saved adapter at a time.

A request names the adapter it samples from (a saved state's path) or none (the base
model). With the "local" engine (transformers), each adapter shape (rank, alpha,
adapted modules) has its engine, a copy of the base with that shape's LoRA layers, and
the base model one without. With "vllm" or "vllm-server", the run's own engine serves
every shape up to ``engine_options.lora_rank`` (which must be set: vLLM is built with
LoRA support only then), and the base model as an adapter whose up-projection is zero
(it adds exactly nothing). An engine switches
to another adapter only when no generation runs on the one it serves, and a switch is
an ordinary ``update_adapter``, so concurrent requests for the same adapter share it
and a request never samples from another's weights.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from corun.base.config import Config
from corun.base.errors import ConfigError
from corun.contract.engine import Adapter, AdapterEngine, Engine, Generation, Sampling
from corun.contract.trainer import SetupContext
from corun.contract.training_api import RequestError
from corun.engines.options import EngineOptions
from corun.engines.start import EngineKind, start_engine
from trainers.hf.lora import LoraSettings, adapter, add_lora
from trainers.hf.policy import HFPolicy

KEPT_ADAPTERS = 16  # saved adapters kept read in memory (most recently used)
BASE = Path("<base model>")  # the base model's zero adapter, as the engine knows it


@dataclass(frozen=True)
class SavedAdapter:
    """An adapter saved at ``path``, as its engine takes it."""

    path: Path
    settings: LoraSettings
    adapter: Adapter

    @property
    def shape(self) -> tuple[int, float, tuple[str, ...]]:
        s = self.settings
        return (s.rank, s.alpha, tuple(sorted(s.target_modules)))


class _Slot:
    """One engine and the adapter it serves; :meth:`using` switches it when idle."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.serving: Path | None = None
        self.running = 0
        self.changed = anyio.Condition()

    @asynccontextmanager
    async def using(self, saved: SavedAdapter | None) -> AsyncIterator[Engine]:
        want = None if saved is None else saved.path
        async with self.changed:
            while self.serving != want and self.running:
                await self.changed.wait()
            if saved is not None and self.serving != want:
                assert isinstance(self.engine, AdapterEngine)
                await self.engine.update_adapter(saved.adapter, self.engine.version + 1)
                self.serving = want
            self.running += 1
        try:
            yield self.engine
        finally:
            with anyio.CancelScope(shield=True):
                async with self.changed:
                    self.running -= 1
                    self.changed.notify_all()


class Samplers:
    """The engines of one base policy, by adapter shape (None: the base model)."""

    def __init__(
        self, base: HFPolicy, pad_id: int, kind: EngineKind, options: EngineOptions,
        config: Config, engine: Engine | None = None,
    ) -> None:  # fmt: skip
        """``engine``: the run's started engine, which a "vllm" or "vllm-server" kind
        samples with (the "local" kind starts its own, one per adapter shape)."""
        self.base = base
        self.pad_id = pad_id
        self.kind = kind
        self.options = options
        self.config = config
        self._base_adapter: SavedAdapter | None = None
        self._slots: dict[Any, _Slot] = {}
        if kind != "local":
            if engine is None or options.lora_rank is None:
                raise ConfigError(
                    "`$.trainer.engine_options.lora_rank`: the Tinker API samples LoRA "
                    f"adapters on the {kind!r} engine: set the highest rank clients use "
                    "(e.g. 32), so that vLLM is built with LoRA support"
                )
            self._slots[None] = _Slot(engine)
        self._starting = anyio.Lock()
        self._shutdowns: list[Callable[[], Awaitable[None] | None]] = []
        self._adapters: OrderedDict[Path, SavedAdapter] = OrderedDict()
        self._adapters_lock = threading.Lock()

    def adapter_at(self, path: Path, read: Callable[[], SavedAdapter]) -> SavedAdapter:
        """The adapter saved at ``path`` (read once, kept while recently used)."""
        with self._adapters_lock:  # sampling reads on the loop, prompt log-probs on a lane
            saved = self._adapters.get(path)
            if saved is None:
                saved = self._adapters[path] = read()
                while len(self._adapters) > KEPT_ADAPTERS:
                    self._adapters.popitem(last=False)
            self._adapters.move_to_end(path)
            return saved

    async def sample(
        self, saved: SavedAdapter | None, prompts: Sequence[Sequence[int]], sampling: Sampling,
        seed: int,
    ) -> list[Generation]:  # fmt: skip
        if self.kind != "local":
            saved = await self._for_vllm(saved)
        slot = await self._slot(saved)
        async with slot.using(saved) as engine:
            return await engine.generate(prompts, sampling, seed)

    async def _for_vllm(self, saved: SavedAdapter | None) -> SavedAdapter:
        """``saved``, or the base model's zero adapter; a rank the engine cannot take
        refused."""
        if saved is None:
            if self._base_adapter is None:
                zero = LoraSettings(rank=1)  # B starts at zero: the base, exactly
                policy = await anyio.to_thread.run_sync(self._copy, zero)
                self._base_adapter = SavedAdapter(BASE, zero, adapter(policy))
            return self._base_adapter
        if saved.settings.rank > (self.options.lora_rank or 0):
            raise RequestError(
                f"LoRA rank {saved.settings.rank}: the {self.kind!r} engine takes ranks up "
                f"to {self.options.lora_rank} (trainer.engine_options.lora_rank)"
            )
        return saved

    async def _slot(self, saved: SavedAdapter | None) -> _Slot:
        key = None if saved is None or self.kind != "local" else saved.shape
        async with self._starting:  # one start per shape, even for requests arriving together
            if key not in self._slots:
                self._slots[key] = _Slot(await self._start(saved))
        return self._slots[key]

    async def _start(self, saved: SavedAdapter | None) -> Engine:
        ctx = SetupContext(self.config, register=lambda _, fn: self._shutdowns.append(fn))
        settings = None if saved is None else saved.settings
        policy = await anyio.to_thread.run_sync(self._copy, settings)
        return await start_engine("local", self.options, policy, self.pad_id, ctx,
                                  interrupt=False)  # fmt: skip

    def _copy(self, lora: LoraSettings | None) -> HFPolicy:
        """A copy of the base model, with ``lora``'s layers (blocking: off the loop)."""
        policy = copy.deepcopy(self.base)
        if lora is not None:
            add_lora(policy, lora, 0)
        return policy

    async def close(self) -> None:
        """Shut every engine down (bounded each), newest first."""
        shutdowns, self._shutdowns = self._shutdowns[::-1], []
        for shutdown in shutdowns:
            done = shutdown()
            if done is not None:
                await done
