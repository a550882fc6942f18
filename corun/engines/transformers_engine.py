"""The in-process rollout engine of a Hugging Face policy (``engine = "local"``):
``transformers`` forward passes with a KV cache (decode.py) behind the async engine
interface of corun/contract/engine.py.

The engine samples from its own copy of the weights, which only a weight update
changes. Its compute runs on one lane: the train lane at concurrency 1 (rollouts and
updates alternate there, as a hand-written loop would run them), its own otherwise,
so generation overlaps training. Generation calls are batched continuously
(continuous.py): a call joins the running batch at the next decode step. One of the
waiting callers runs the batch on the lane for all of them, a lane call until some call
finishes (its caller is then woken, and the next lane call goes on). An update lets the
calls begun before it finish on their weights, and those begun while it waits start
after it ("drain"); with ``interrupt`` an update is picked up between two decode steps
instead (a partial rollout), and the sync does not wait for generations at all.

Its fingerprint (corun/engines/fingerprint.py) is of what a generation started now
would use: its model's state, or, with ``interrupt``, that state with the weights
published and not yet picked up in place of its own (the engine's snapshot of them,
which is what it will load).

Precision: the copy keeps its floating-point weights in the engine's dtype
(``[trainer.engine_options] dtype``), whatever the trainer's; loading rounds the
trained weights to it.

LoRA (``[trainer.lora]``): the trainer's model carries peft's injected LoRA layers, and
so does the engine's copy; :meth:`TransformersEngine.update_adapter` copies an
adapter's tensors into those layers (corun/engines/lora.py maps the names), with the
same drain or interrupt semantics as a weight update. The fingerprint stays that of
the whole state (base and adapter), as the trainer's state dict holds it.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import anyio
import torch
from torch import Tensor

from corun.contract.engine import Adapter, EngineError, Generation, Sampling, TokenSink
from corun.engines import continuous, decode
from corun.engines.fingerprint import bits_sum, format_fingerprint, weights_fingerprint
from corun.engines.lora import adapter_parameters, parameter_name
from corun.execution.compute import Lane, blocking_io

T = TypeVar("T")


@dataclass(frozen=True)
class _Update:
    """Weights to load as ``version``: a whole state dict, or (``partial``) an adapter's
    tensors under the model's parameter names."""

    version: int
    tensors: Mapping[str, Tensor]
    partial: bool = False


class TransformersEngine:
    """Samples from its own copy of ``policy.model``, the model it decodes (it is a
    :class:`decode.CausalLM` itself), its floating-point weights in ``dtype`` (default:
    the policy's), on the policy's device (the run's)."""

    def __init__(
        self, policy: decode.CausalLM, pad_id: int, lane: Lane, *, owns_lane: bool,
        interrupt: bool, dtype: torch.dtype | None = None, shared: bool = False,
        max_rows: int | None = None,
    ) -> None:  # fmt: skip
        # ``shared``: the policy's own model, not a copy (a synchronous run, where
        # generation and updates alternate on one lane: see start.py's shares_weights).
        # A weight update then has nothing to copy; it only advances the version.
        self.shared = shared
        # On the policy's device (the run's): generation computes there.
        self.model = policy.model if shared else copy.deepcopy(policy.model).eval()
        self.device = next(self.model.parameters()).device
        if not shared:
            for parameter in self.model.parameters():
                parameter.requires_grad_(False)
        if dtype is not None and not shared:
            _cast(self.model, dtype)
        self.dtype = dtype
        state = self.model.state_dict()
        # The injected LoRA layers' parameters and shapes: what an adapter must fill.
        self._adapter_shapes = {name: state[name].shape for name in adapter_parameters(state)}
        self._base_bits: int | None = None  # the base weights' bit sum, under LoRA
        self.pad_id = pad_id
        self.lane = lane
        self._owns_lane = owns_lane
        self._interrupt = interrupt
        self._version = 0
        self._lock = threading.Lock()
        self._pending: _Update | None = None
        self._loading: _Update | None = None  # taken, being loaded
        self._resumed = anyio.Event()
        self._resumed.set()
        self._closed = False
        # Continuous batching (continuous.py): the running calls' rows, stepped by one
        # of their callers at a time; the others wait on their wake events.
        self._batch = continuous.RunningBatch(self.model, pad_id, max_rows)
        self._stepping = False
        self._wakes: dict[continuous.Call, anyio.Event] = {}
        # The calls whose callers wait (kept on the event loop: the batch's own lists
        # change on the lane's thread during a step).
        self._live: set[continuous.Call] = set()
        self._idle = anyio.Event()  # set once no call is live
        self._draining: anyio.Event | None = None  # a drained update: set once it loaded

    @property
    def version(self) -> int:
        return self._version

    @property
    def interrupts(self) -> bool:
        return self._interrupt

    async def generate(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int
    ) -> list[Generation]:
        return await self.generate_stream(prompts, sampling, seed, None)

    async def generate_stream(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int,
        sink: TokenSink | None,
    ) -> list[Generation]:  # fmt: skip
        """:meth:`generate`, each step's tokens to ``sink`` as they are drawn (a row it
        declines stops at once; corun/contract/engine.py's streaming rules)."""
        await self._resumed.wait()
        while self._draining is not None:  # an update waits for the calls before it
            await self._draining.wait()
        if self._closed:
            raise EngineError("the transformers engine is shut down")
        # Drawn on the model's device: the CPU's stream on a CPU run, as before.
        generator = torch.Generator(self.device).manual_seed(seed)
        call = continuous.Call([list(p) for p in prompts], sampling, generator, sink)
        if call.empty():
            return []
        self._live.add(call)
        self._batch.submit(call)
        try:
            await self._until_over(call)
        finally:
            call.left = not call.over  # its rows leave the batch at the next step
            self._wakes.pop(call, None)
            self._live.discard(call)
            self._note_idle()
        if call.error is not None:
            raise call.error
        assert call.result is not None
        return call.result

    async def _until_over(self, call: continuous.Call) -> None:
        """Wait for ``call`` to be answered, running the batch's steps while no other
        caller does (one caller at a time steps it, for all of them)."""
        while not call.over:
            if self._stepping:
                self._wakes[call] = wake = anyio.Event()
                await wake.wait()
                continue
            self._stepping = True
            try:
                while not call.over:
                    await self._step()
            finally:
                self._stepping = False
                for waiting in list(self._wakes.values()):  # one of them steps on
                    waiting.set()

    async def _step(self) -> None:
        try:
            finished = await self.lane.run(self._batch.steps, self._current_weights)
        except Exception as exc:  # a step's failure is every running call's
            finished = self._batch.reset(exc)
        for call in finished:
            if call in self._wakes:
                self._wakes[call].set()
        if self.lane.mode == "inline":  # the step blocked the event loop: let it run
            await anyio.lowlevel.checkpoint()

    def _note_idle(self) -> None:
        if not self._live:
            self._idle.set()

    async def _drained(self) -> None:
        """Until every call running or waiting has been answered (or left)."""
        while self._live:
            if self._idle.is_set():
                self._idle = anyio.Event()
            await self._idle.wait()

    async def score(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        return await self._scoring(decode.score, prompts, completions)

    async def distributions(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[Tensor]:
        return await self._scoring(decode.distributions, prompts, completions)

    async def _scoring(
        self, scorer: Callable[..., T], prompts: Sequence[Sequence[int]],
        completions: Sequence[Sequence[int]],
    ) -> T:  # fmt: skip
        await self._resumed.wait()
        if self._closed:
            raise EngineError("the transformers engine is shut down")
        rows, tails = [list(p) for p in prompts], [list(c) for c in completions]
        return await self.lane.run(scorer, self, rows, tails, self.pad_id)

    def _current_weights(self) -> int:
        """Between decode steps (on the lane): take weights published since, if any."""
        with self._lock:
            pending, self._pending = self._pending, None
            self._loading = pending
        if pending is not None:
            try:
                self._load(pending)
            finally:
                with self._lock:
                    self._loading = None
        return self._version

    def _load(self, update: _Update) -> None:
        """Copy ``update`` into the model tensor by tensor, in the order it yields them:
        a state gathered from shards as it is read (corun/execution/parallel.py) is
        never held whole beside the model. A shared model has the weights already."""
        if self.shared:
            self._version = update.version
            return
        own = self.model.state_dict()  # the model's tensors themselves (detached views)
        loaded = set()
        with torch.no_grad():
            for name, tensor in update.tensors.items():
                target = own.get(name)
                if target is None or target.shape != tensor.shape:
                    raise EngineError(f"weight {name!r} does not fit the engine's model")
                target.copy_(tensor)
                loaded.add(name)
        missing = sorted(own.keys() - loaded)
        if missing and not update.partial:
            raise EngineError(f"the weights lack the engine's {missing[0]!r}")
        if not update.partial:
            self._base_bits = None  # the base weights changed
        self._version = update.version

    async def update_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        await self._publish(_Update(version, state))

    async def update_adapter(self, adapter: Adapter, version: int) -> None:
        """Copy ``adapter``'s tensors into the model's injected LoRA layers as policy
        ``version`` (a tensor the model has no place for, or a LoRA parameter the
        adapter lacks, is an :class:`EngineError` naming it; nothing is loaded then)."""
        await self._publish(_Update(version, self._adapter_state(adapter), partial=True))

    async def _publish(self, update: _Update) -> None:
        if self._interrupt:
            # A snapshot: the trainer goes on changing its weights after this returns.
            snapshot = _Update(
                update.version, _snapshot(update.tensors, self.dtype), update.partial
            )
            with self._lock:
                self._pending = snapshot
            return
        # Drain: the calls begun before the update finish on their weights, and those
        # begun while it waits start after it.
        self._draining = draining = anyio.Event()
        try:
            await self._drained()
            await self.lane.run(self._load, update)
        finally:
            self._draining = None
            draining.set()

    def _adapter_state(self, adapter: Adapter) -> dict[str, Tensor]:
        """The adapter's tensors under the model's names, checked against its layers."""
        shapes = self._adapter_shapes
        if not shapes:
            raise EngineError(
                "the transformers engine's model has no LoRA layers (the trainer's model "
                "has no peft adapter injected)"
            )
        state = {}
        for name, tensor in adapter.tensors.items():
            try:
                target = parameter_name(name)
            except ValueError as exc:
                raise EngineError(f"adapter tensor {exc}") from None
            if target not in shapes:
                raise EngineError(f"adapter tensor {name!r}: the model has no {target!r}")
            if tensor.shape != shapes[target]:
                raise EngineError(
                    f"adapter tensor {name!r}: shape {list(tensor.shape)}, the model's "
                    f"{target!r} has {list(shapes[target])}"
                )
            state[target] = tensor
        missing = sorted(shapes.keys() - state.keys())
        if missing:
            raise EngineError(f"the adapter has no tensor for the model's {missing[0]!r}")
        return state

    async def fingerprint(self) -> str:
        # In a worker thread (inline in inline mode): it only reads, and a large model
        # takes a moment.
        return await blocking_io(self.lane.mode, self._fingerprint)

    def _fingerprint(self) -> str:
        with self._lock:
            published = self._pending or self._loading
        state = self.model.state_dict()
        if published is not None:  # what the next decode step loads, in place of its own
            # No update is in flight but this one (syncs do not overlap).
            state = {**state, **published.tensors}
        if not self._adapter_shapes or (published is not None and not published.partial):
            return weights_fingerprint(state.values())
        # LoRA: the base weights change only by a whole update, so their sum is kept
        # and an adapter sync sums the adapter alone.
        if self._base_bits is None:
            base = (t for name, t in state.items() if name not in self._adapter_shapes)
            self._base_bits = bits_sum(base)
        adapters = (state[name] for name in self._adapter_shapes)
        return format_fingerprint(self._base_bits + bits_sum(adapters))

    async def pause(self) -> None:
        self._resumed = anyio.Event()
        await self._drained()  # generations begun before the pause finish
        await self.lane.run(lambda: None)  # and scoring queued before it

    async def resume(self) -> None:
        self._resumed.set()

    async def health(self) -> bool:
        return not self._closed

    async def shutdown(self) -> None:
        self._closed = True
        self._resumed.set()
        if self._owns_lane:
            self.lane.close()


def _cast(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The model's floating-point parameters, and buffers in its state dict, in
    ``dtype`` (tied parameters stay one; buffers outside the state dict, such as rotary
    frequencies, keep their precision, as vLLM's do)."""
    persistent = set(model.state_dict(keep_vars=True))
    for parameter in model.parameters():
        if parameter.is_floating_point():
            parameter.data = parameter.data.to(dtype)
    for module_name, module in model.named_modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            key = f"{module_name}.{name}" if module_name else name
            if buffer.is_floating_point() and key in persistent:
                module.register_buffer(name, buffer.to(dtype))


def _snapshot(state: Mapping[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
    """A copy of ``state``, floating-point tensors in ``dtype`` (if given: what loading
    rounds them to), in which tensors that shared storage still share it (tied weights
    stay one tensor, as in the model)."""
    copies: dict[tuple[object, ...], Tensor] = {}
    out = {}
    for key, value in state.items():
        value = value.detach()
        ident = (value.device, value.dtype, value.data_ptr(), value.shape, value.stride())
        if ident not in copies:
            cast = dtype is not None and value.is_floating_point()
            copies[ident] = value.to(dtype, copy=True) if cast else value.clone()
        out[key] = copies[ident]
    return out
