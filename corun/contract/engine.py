"""The rollout-engine interface: what a trainer's rollouts and the policy endpoint need
of whatever generates — an in-process model, a transformers model, vLLM in-process,
or a vLLM server behind HTTP — without knowing which.

Token ids in, token ids out: an engine never sees text, so what it samples is what is
trained (no re-tokenization). Each sampled token comes with its behaviour log-prob —
under the temperature-scaled distribution, before top-p truncation, which is what a
trainer recomputes, so the ratio is 1 for unchanged weights — and the policy version
of the weights that produced it; on request, also the most likely tokens of each step
under that same distribution (``top_logprobs``, for an OpenAI-style endpoint). After a
weight sync the engine reports a fingerprint of the weights it serves, computed from
its own copy (corun/engines/fingerprint.py), so a sync that did not take is caught.
Every method is ``async``: an engine behind I/O awaits it; an in-process one runs its
compute on a lane.

Streaming: an engine that can hand each decode step's tokens out as they are sampled
is a :class:`StreamingEngine` (``generate_stream``, with a :data:`TokenSink`); callers go
through :func:`generate_streamed`, which runs any other engine's whole-reply
``generate`` and hands each row over as one :class:`Delta` at the end — so an engine
gains streaming by adding ``generate_stream`` alone, and nothing else changes. The
rules of a sink: it is called ``sink(row, delta)`` for each row's new tokens, in
order, on whatever thread samples them (an engine's lane, or the event loop), so it
must be thread-safe and must not block; a row's deltas joined are its
:class:`Generation`'s tokens (its stop token included); and a sink that returns False
for a row asks the engine to stop generating that row (its client is gone, or a stop
string ended it): the engine stops it within a step or so, the other rows go on, and
the row's Generation holds the tokens sampled until then (``finish`` "length" unless
it stopped on its own). The transformers engine, in-process vLLM and the vLLM server
engine stream; the fleet delivers whole replies through the fallback.

Kept free of any engine's types, so another engine (SGLang, say) is an adapter away.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

from torch import Tensor

MAX_TOP_LOGPROBS = 20  # the most top log-probs a Sampling may ask for (OpenAI's limit)


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()  # a sampled stop id ends the sequence (it is kept)
    # Per sampled token, also this many most likely tokens (ids, log-probs) under the
    # distribution of the behaviour log-prob (temperature-scaled, before top-p).
    top_logprobs: int = 0
    # Draw from the k most likely tokens only (0: all), before top-p (as vLLM orders
    # them); the behaviour log-prob stays the untruncated one, as with top-p.
    top_k: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs {self.top_logprobs} is not in 0..{MAX_TOP_LOGPROBS}")
        if self.top_k < 0:
            raise ValueError(f"top_k {self.top_k} is negative")
        if self.top_k and self.top_logprobs:  # vLLM reads the tokens it cut as -inf
            raise ValueError("top_k and top_logprobs together are not supported")


Finish = Literal["stop", "length"]


@dataclass
class Generation:
    """One sampled continuation of a prompt."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish: Finish
    # With Sampling.top_logprobs: per token, the most likely (id, log-prob), best first.
    top: list[list[tuple[int, float]]] | None = None


@dataclass(frozen=True)
class Delta:
    """A row's tokens sampled since its last delta: ids, behaviour log-probs, the
    version of each and (with ``Sampling.top_logprobs``) each step's top tokens."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    top: list[list[tuple[int, float]]] | None = None


# sink(row, delta) -> whether that row is still wanted (see the module's docstring).
TokenSink = Callable[[int, Delta], bool]


def deliver(generations: Sequence[Generation], sink: TokenSink) -> None:
    """Whole generations handed to ``sink`` as one delta per row (a whole-reply engine's
    streaming)."""
    for row, done in enumerate(generations):
        if done.ids:
            sink(row, Delta(done.ids, done.logprobs, done.versions, done.top))


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter as ``peft`` saves one: the contents of its adapter_config.json and
    its tensors under the names of adapter_model.safetensors
    (``base_model.model.<module>.lora_A.weight``). Only these train and travel under
    ``[trainer.lora]``; the engine keeps the base weights it started with."""

    config: Mapping[str, Any]
    tensors: Mapping[str, Tensor]


class EngineError(RuntimeError):
    """The engine failed or died; the run fails with this message, one line."""


class ScoringRefused(EngineError):
    """The engine does not score tokens (it was started to sample, or scores only the
    sampled tokens where whole rows were asked for); it is still usable."""


class Engine(Protocol):
    """A rollout engine. ``version`` is the policy version of its weights."""

    @property
    def version(self) -> int: ...

    @property
    def interrupts(self) -> bool:
        """Whether weights can change between two decode steps of a running generation
        (partial rollouts); otherwise an update waits for running generations."""
        ...

    async def generate(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int
    ) -> list[Generation]:
        """One continuation per prompt; all draws from ``seed``."""
        ...

    async def update_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        """Load ``state`` (the trained model's state dict) as policy ``version``."""
        ...

    async def fingerprint(self) -> str:
        """A fingerprint of the weights a generation started now would use, computed
        from the engine's own copy (corun/engines/fingerprint.py): equal to
        ``weights_fingerprint`` of the state it last loaded, if it loaded it."""
        ...

    async def pause(self) -> None:
        """Let running generations finish and start no new ones until :meth:`resume`."""
        ...

    async def resume(self) -> None: ...

    async def health(self) -> bool: ...

    async def shutdown(self) -> None:
        """Release everything (bounded; a child process is killed as a group)."""
        ...


@runtime_checkable
class StreamingEngine(Protocol):
    """An engine that hands out each decode step's tokens as they are sampled."""

    async def generate_stream(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int, sink: TokenSink
    ) -> list[Generation]:
        """:meth:`Engine.generate`, each row's new tokens also given to ``sink`` as they
        are sampled (the rules: the module's docstring)."""
        ...


async def generate_streamed(
    engine: Engine, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int,
    sink: TokenSink | None,
) -> list[Generation]:  # fmt: skip
    """``engine``'s generations of ``prompts``, streamed to ``sink`` (when given): step by
    step by a :class:`StreamingEngine`, else each row at once when its call returns."""
    if sink is None:
        return await engine.generate(prompts, sampling, seed)
    if isinstance(engine, StreamingEngine):
        return await engine.generate_stream(prompts, sampling, seed, sink)
    done = await engine.generate(prompts, sampling, seed)
    deliver(done, sink)
    return done


@runtime_checkable
class AdapterEngine(Protocol):
    """An engine that takes LoRA adapters: it serves base weights plus the newest adapter,
    and a generation runs to its end on the adapter it started with."""

    async def update_adapter(self, adapter: Adapter, version: int) -> None:
        """Serve ``adapter`` as policy ``version`` from the next generation on; its
        ``fingerprint`` is then of the base weights with this adapter."""
        ...


@runtime_checkable
class ScoringEngine(Protocol):
    """An engine that also scores given tokens: a distillation teacher's
    (trainers/hf/distill.py). Scores are under the weights' own distribution
    (temperature 1, nothing truncated)."""

    async def score(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        """Per completion, each token's log-prob given its prompt and the completion's
        tokens before it."""
        ...

    async def distributions(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[Tensor]:
        """Per completion, the whole log-prob row at each of its tokens (tokens, vocab),
        on the CPU: what an exact per-token KL needs. An engine that returns top-k
        log-probs only (vLLM) raises :class:`EngineError`."""
        ...


@runtime_checkable
class SleepingEngine(Protocol):
    """An engine on the trainer's GPU that gives its memory back while the trainer
    steps (vLLM's sleep mode): the template calls :meth:`sleep` before each update and
    :meth:`wake` after the step's sync, so the order is sleep → train → sync → wake. A
    weight update while asleep first brings its weights back."""

    async def sleep(self, keep_weights: bool) -> None:
        """Release the engine's device memory; its weights are kept (offloaded) when
        ``keep_weights``, else dropped (a weight update follows before the wake)."""
        ...

    async def wake(self) -> None:
        """Take the memory back; the engine serves again."""
        ...


class TransferTarget(NamedTuple):
    backend: str  # vLLM's weight-transfer backend: "nccl"
    workers: int  # the engine's GPU workers (ranks 1.. of the trainer's NCCL group)
    dtype: str  # the precision its weights are sent in: "bfloat16"


@runtime_checkable
class TransferEngine(Protocol):
    """An engine that takes weights through vLLM's weight-transfer API (a fleet
    member's vLLM on CUDA): the trainer drives the steps, the tensors go GPU to GPU."""

    def transfer_target(self) -> TransferTarget | None:
        """What the engine receives over NCCL; None: it was not started to."""
        ...

    async def transfer_step(self, step: str, body: dict[str, Any]) -> None:
        """One of vLLM's weight-transfer calls (corun/contract/fleet.py's
        ``TRANSFER_STEPS``) with its HTTP body; generation pauses from
        ``start_weight_update`` to ``finish_weight_update``, whose ``weight_version``
        becomes the engine's version."""
        ...


@runtime_checkable
class MeasuredEngine(Protocol):
    """An engine with figures of its own for the step's metrics (a fleet's members)."""

    def metrics(self) -> dict[str, float]: ...


def engine_metrics(engine: object) -> dict[str, float]:
    """``engine``'s own figures, if it has any (:class:`MeasuredEngine`)."""
    return engine.metrics() if isinstance(engine, MeasuredEngine) else {}


class EngineWrapper:
    """An :class:`Engine` that passes every call to ``inner``: a wrapper (instruments,
    injected faults) overrides only the calls it adds to."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner

    @property
    def version(self) -> int:
        return self.inner.version

    @property
    def interrupts(self) -> bool:
        return self.inner.interrupts

    async def generate(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int
    ) -> list[Generation]:
        return await self.inner.generate(prompts, sampling, seed)

    async def generate_stream(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int, sink: TokenSink
    ) -> list[Generation]:
        """``inner``'s stream; a wrapper that overrides ``generate`` (and not this) is
        streamed through its own ``generate``, a delta per row at the end."""
        if type(self).generate is not EngineWrapper.generate:
            done = await self.generate(prompts, sampling, seed)
            deliver(done, sink)
            return done
        return await generate_streamed(self.inner, prompts, sampling, seed, sink)

    async def update_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        await self.inner.update_weights(state, version)

    async def update_adapter(self, adapter: Adapter, version: int) -> None:
        """``inner``'s (:class:`AdapterEngine`); an :class:`EngineError` if it has none."""
        if not isinstance(self.inner, AdapterEngine):
            raise EngineError(f"{type(self.inner).__name__} takes no LoRA adapters")
        await self.inner.update_adapter(adapter, version)

    async def fingerprint(self) -> str:
        return await self.inner.fingerprint()

    async def pause(self) -> None:
        await self.inner.pause()

    async def resume(self) -> None:
        await self.inner.resume()

    async def health(self) -> bool:
        return await self.inner.health()

    async def shutdown(self) -> None:
        await self.inner.shutdown()
