"""Deadlines: everything a run waits on ends within a set time — a weight sync, an
engine's start-up, its calls and its shutdown, and the user's code the loop calls: an
evaluation, a data source's batch, a checkpoint write, each reward function call and
environment step — so a hang fails the run with one line instead of holding it until
a signal and ``run.hard_deadline_s``.

A deadline cancels what it bounds. A lane call stuck in a blocking call (one that
never reaches a cancel point: a hung C call) is abandoned after a grace of
``min(deadline, 5 s)`` — its thread is left to it and the lane goes on with a fresh
one (corun/execution/compute.py) — and the run fails with :class:`DeadlineError`, naming what
overran and the setting that bounds it::

    corun: error: weight sync to version 3 did not finish within 5 s (run.sync_timeout_s)

Teardown then runs in order as after any error, and ``corun`` ends the process even
though an abandoned thread is still stuck. In inline compute mode (no threads), and in
an ``async def`` hook that blocks the event loop instead of awaiting, a blocking call
cannot be cut short: deadlines bound awaits only.

The settings:

- ``run.sync_timeout_s``: the loop's weight sync (corun/loop/sync.py: ``sync_weights``
  and the remote workers' publish);
- an engine's own under ``[trainer.engine_options]`` for the hf kinds
  (``start_timeout_s``, ``request_timeout_s``, ``shutdown_timeout_s``:
  corun/engines/start.py, through :class:`BoundedEngine`);
- ``run.eval_timeout_s``: each evaluation (corun/loop/evaluation.py);
- ``run.data_timeout_s``: each batch fetched from the trainer's dataset
  (corun/loop/producer.py);
- ``checkpoint.write_timeout_s``: each checkpoint write (corun/loop/checkpointer.py;
  the previous checkpoint stays the latest);
- ``run.reward_timeout_s``: each reward function call on one sample, the prompt named
  in the line (trainers/hf/rewards.py, through corun/contract/user_calls.py's
  :class:`CallDeadlines`);
- ``trainer.env.step_timeout_s`` (agentic kinds): each environment reset and step;
  an overrun ends its episode, not the run (corun/agents/runner.py).

:class:`DeadlineError` and :func:`deadline` live in corun/contract/user_calls.py, below
this layer, because trainers bound their reward calls with them too.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import anyio
from torch import Tensor

from corun.contract.engine import (
    Adapter,
    AdapterEngine,
    Engine,
    EngineError,
    Generation,
    Sampling,
    ScoringEngine,
    ScoringRefused,
    SleepingEngine,
    TokenSink,
    engine_metrics,
    generate_streamed,
)
from corun.contract.user_calls import DeadlineError as DeadlineError
from corun.contract.user_calls import deadline as deadline


class BoundedEngine:
    """An :class:`Engine` whose every call has a deadline: ``generate``, ``score`` and
    ``distributions`` (an :class:`EngineError` if the engine scores nothing), ``pause``,
    ``update_weights``, ``update_adapter`` (an :class:`EngineError` if the engine takes
    no adapters) and ``fingerprint`` ``request_timeout_s``, ``shutdown``
    ``shutdown_timeout_s``.

    An engine that overran a deadline, or whose weight update was cut short (its
    weights are then unknown), is dead: ``health()`` is false and every later call
    fails at once with :class:`EngineError` — nothing waits on it again. ``inner`` is
    set once the engine has started (register :meth:`shutdown` for teardown before
    starting it: a start cut short still shuts down what began).
    """

    def __init__(
        self, name: str, where: str, request_timeout_s: float, shutdown_timeout_s: float
    ) -> None:
        self.name = name  # "the 'local' engine"
        self.where = where  # the settings' table: "trainer.engine_options"
        self.request_timeout_s = request_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.inner: Engine | None = None
        self.dead: str | None = None
        self._stopped = False

    @property
    def version(self) -> int:
        return 0 if self.inner is None else self.inner.version

    @property
    def interrupts(self) -> bool:
        return self.inner is not None and self.inner.interrupts

    async def generate(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int
    ) -> list[Generation]:
        with self._request("generate"):
            return await self._live().generate(prompts, sampling, seed)

    async def generate_stream(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int, sink: TokenSink
    ) -> list[Generation]:
        """``generate``, streamed to ``sink`` by an engine that streams (else each row at
        the end: corun/contract/engine.py's ``generate_streamed``), under the same
        deadline."""
        with self._request("generate"):
            return await generate_streamed(self._live(), prompts, sampling, seed, sink)

    async def score(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        inner = self._live()
        if not isinstance(inner, ScoringEngine):
            raise ScoringRefused(f"{self.name} does not score tokens")
        with self._request("scoring"):
            return await inner.score(prompts, completions)

    async def distributions(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[Tensor]:
        inner = self._live()
        if not isinstance(inner, ScoringEngine):
            raise ScoringRefused(f"{self.name} does not score tokens")
        with self._request("scoring"):
            return await inner.distributions(prompts, completions)

    async def update_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        done = False
        try:
            with self._request(f"weight update to version {version}"):
                await self._live().update_weights(state, version)
                done = True
        finally:
            if not done and self.dead is None:
                self.dead = f"its weight update to version {version} did not complete"

    async def update_adapter(self, adapter: Adapter, version: int) -> None:
        inner = self._live()
        if not isinstance(inner, AdapterEngine):
            raise EngineError(f"{self.name} takes no LoRA adapters")
        try:
            with self._request(f"adapter update to version {version}"):
                await inner.update_adapter(adapter, version)
        except EngineError:  # the engine's own failure: it knows whether it is usable
            raise
        except BaseException:  # cut short: what it serves is unknown
            if self.dead is None:
                self.dead = f"its adapter update to version {version} did not complete"
            raise

    async def fingerprint(self) -> str:
        with self._request("weights fingerprint"):
            return await self._live().fingerprint()

    async def pause(self) -> None:
        with self._request("pause"):
            await self._live().pause()

    async def resume(self) -> None:
        await self._live().resume()

    async def health(self) -> bool:
        if self.dead is not None or self.inner is None:
            return False
        with anyio.move_on_after(self.request_timeout_s):
            return await self.inner.health()
        return False

    async def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.dead = self.dead or "it was shut down"
        if self.inner is not None:
            setting = f"{self.where}.shutdown_timeout_s"
            with deadline(f"{self.name}'s shutdown", self.shutdown_timeout_s, setting):
                await self.inner.shutdown()

    def metrics(self) -> dict[str, float]:
        return engine_metrics(self.inner)

    def sleeper(self) -> SleepingEngine:
        """The started engine's sleep and wake (it must have them), under the request
        deadline; a wrapper set around it later is bypassed (it wraps the calls)."""
        started = self._live()
        if not isinstance(started, SleepingEngine):
            raise EngineError(f"{self.name} cannot sleep (no colocation)")
        return _BoundedSleep(self, started)

    def _live(self) -> Engine:
        if self.dead is not None or self.inner is None:
            raise EngineError(f"{self.name} is unusable: {self.dead or 'not started'}")
        return self.inner

    @contextmanager
    def _request(self, what: str) -> Iterator[None]:
        setting = f"{self.where}.request_timeout_s"
        try:
            with deadline(f"{self.name}'s {what}", self.request_timeout_s, setting):
                yield
        except DeadlineError as exc:
            self.dead = str(exc)
            raise


class _BoundedSleep:
    """:meth:`BoundedEngine.sleeper`: sleep and wake with the engine's deadline."""

    def __init__(self, bounded: BoundedEngine, engine: SleepingEngine) -> None:
        self.bounded, self.engine = bounded, engine

    async def sleep(self, keep_weights: bool) -> None:
        self.bounded._live()
        with self.bounded._request("sleep"):
            await self.engine.sleep(keep_weights)

    async def wake(self) -> None:
        self.bounded._live()
        with self.bounded._request("wake"):
            await self.engine.wake()
