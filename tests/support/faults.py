"""Fault injection for tests: engines, weight syncs, evaluators, reward functions,
environments, data sources and checkpoint writes that fail, hang or slow down on
command, inside real runs of the real runtime (``corun.run`` in process, or ``corun
train`` as a subprocess).

A fault is a :class:`Fault` — which phase, at which occurrence, what happens::

    Fault(phase="sync", step=3, action="hang")     # the 3rd weight sync never returns

given to one of the trainer kinds here in its ``faults`` setting (a TOML array of
tables: ``trainer.faults = [{phase = "sync", step = 3, action = "hang"}]``), or, for a
reward function used by any kind, in the ``CORUN_FAULTS`` environment variable (the
same array as JSON). The kinds are the real trainers with the fault points added:

- ``tests.support.faults:FaultyFake`` (tests/support/fakes.py's FakeTrainer: plain hooks on compute
  lanes; ``spawn_engine = true`` gives it a child process to check for leaks):
  ``sync`` (its sync_weights, on the train lane), ``eval``, ``data``, ``checkpoint``.
- ``tests.support.faults:FaultyGRPO`` (``hf_grpo`` with the local transformers engine):
  ``engine_start``, ``generate``, ``sync`` (the engine's weight update),
  ``engine_shutdown`` — each inside the engine's deadlines, on the engine's own lane —
  and ``eval``, ``data``, ``checkpoint``; ``reward`` through the reward function
  ``tests.support.faults:reward``.
- ``tests.support.faults:FaultyAgentic`` (``agentic``): ``env`` (an environment step).

And :class:`SkipReload`, an engine wrapper whose weight updates silently do nothing
(what the weight sync's fingerprint check catches: tests/test_engine_fingerprint.py).

Actions:

- ``raise``: what a real failure of that part raises — :class:`corun.contract.engine.EngineError`
  from an engine, ``OSError(ENOSPC)`` from a checkpoint write (inside the real
  ``torch.save``), :class:`FaultError` elsewhere.
- ``hang``: block in a thread, ignoring cancellation and cancel points, as a hung C
  call would — on the engine's lane for engine phases, on the calling lane for plain
  hooks, in an abandoned worker thread for an environment. Only where a deadline
  bounds the phase (every phase since the user-code deadlines: engine phases,
  ``sync``, ``env``, ``eval``, ``data``, ``checkpoint``, ``reward``). A test
  releases its hung threads with :func:`release_all` (tests/test_faults.py does so
  after every test).
- ``slow``: ``slow_s`` seconds longer (a sleep), nothing else.

``step`` counts the phase's occurrences in the process, from 1 (the 3rd sync is
version 3 when every step syncs); ``times`` faults that many occurrences from there
(0: every later one). A fault that fires touches ``<run dir>/fault-<phase>``, and
:func:`fired` returns (for an in-process test to act at that moment).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.to_thread
import msgspec
import torch
from torch import Tensor

import corun
from corun import Lane
from corun.contract.engine import Engine, EngineError, EngineWrapper, Generation, Sampling
from corun.contract.episodes import Environment, Step
from tests.support.fakes import FakeConfig, FakeTrainer
from trainers.agentic.calculator import EnvSettings
from trainers.agentic.rl import AgenticConfig, AgenticGRPOTrainer
from trainers.hf.rl import HFGRPOConfig, HFGRPOTrainer

Phase = Literal[
    "engine_start", "generate", "sync", "engine_shutdown", "eval", "reward", "env", "data",
    "checkpoint",
]  # fmt: skip
Action = Literal["raise", "hang", "slow"]
ENV = "CORUN_FAULTS"
ENGINE_PHASES = {"engine_start", "generate", "sync", "engine_shutdown"}
# Phases a deadline bounds (corun/loop/deadlines.py, env.step_timeout_s): a hang there ends.
BOUNDED = {*ENGINE_PHASES, "env", "eval", "data", "checkpoint", "reward"}


class Fault(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    phase: Phase
    step: int = 1  # the phase's n-th occurrence in this process, from 1
    action: Action = "raise"
    times: int = 1  # occurrences faulted from `step` on; 0: every later one
    slow_s: float = 0.3

    def __post_init__(self) -> None:
        if self.action == "hang" and self.phase not in BOUNDED:
            raise ValueError(
                f"a hang in {self.phase!r} would hang the test: no deadline bounds it "
                f"(hang one of {sorted(BOUNDED)})"
            )

    def covers(self, occurrence: int) -> bool:
        return occurrence >= self.step and (self.times == 0 or occurrence < self.step + self.times)


class FaultError(RuntimeError):
    """An injected failure (of a part whose real failures have no type of their own)."""


_injectors: list[Injector] = []  # every armed one, for release_all
_armed: Injector | None = None
_fired: dict[str, threading.Event] = {}  # phase → set once a fault of it fires
_fired_lock = threading.Lock()


def _fired_event(phase: str) -> threading.Event:
    with _fired_lock:
        return _fired.setdefault(phase, threading.Event())


async def fired(phase: str) -> None:
    """Return once a fault in ``phase`` has fired (in this process, since the last
    :func:`release_all`)."""
    await anyio.to_thread.run_sync(_fired_event(phase).wait, abandon_on_cancel=True)


class Injector:
    """The faults of one run: counts each phase's occurrences and acts on a match."""

    def __init__(self, faults: Sequence[Fault], run_dir: Path | None = None) -> None:
        self.faults = list(faults)
        self.run_dir = run_dir
        self.counts: Counter[str] = Counter()
        self.fired: list[tuple[str, int, str]] = []  # (phase, occurrence, action)
        self.released = threading.Event()  # ends every hang
        self._lock = threading.Lock()
        _injectors.append(self)

    def due(self, phase: str) -> Fault | None:
        """Count an occurrence of ``phase``; the fault that applies to it, if any."""
        with self._lock:
            self.counts[phase] += 1
            occurrence = self.counts[phase]
            fault = next(
                (f for f in self.faults if f.phase == phase and f.covers(occurrence)), None
            )
            if fault is not None:
                self.fired.append((phase, occurrence, fault.action))
        if fault is not None:
            if self.run_dir is not None and self.run_dir.exists():
                (self.run_dir / f"fault-{phase}").touch()
            _fired_event(phase).set()
        return fault

    def hit(self, phase: str, error: type[Exception] = FaultError) -> None:
        """In plain code (a lane thread): raise, block or sleep if ``phase`` is due."""
        fault = self.due(phase)
        if fault is None:
            return
        if fault.action == "raise":
            raise error(_message(fault, self.counts[phase]))
        if fault.action == "hang":
            self.block()
        else:
            time.sleep(fault.slow_s)

    async def ahit(
        self, phase: str, lane: Lane | None = None, error: type[Exception] = FaultError
    ) -> None:
        """In async code: raise, sleep, or hang a thread — on ``lane`` (its calls then
        wait behind the hung one), else in a worker thread the caller abandons when
        cancelled (as corun/agents/gym.py runs an environment's calls)."""
        fault = self.due(phase)
        if fault is None:
            return
        if fault.action == "raise":
            raise error(_message(fault, self.counts[phase]))
        if fault.action == "slow":
            await anyio.sleep(fault.slow_s)
        elif lane is not None:
            await lane.run(self.block)
        else:
            await anyio.to_thread.run_sync(self.block, abandon_on_cancel=True)

    def block(self) -> None:
        """Until released, ignoring cancel points: a hung C call."""
        self.released.wait()


def _message(fault: Fault, occurrence: int) -> str:
    return f"injected fault: {fault.phase} failed (occurrence {occurrence})"


def arm(faults: Sequence[Fault], run_dir: Path | None = None) -> Injector:
    """Make ``faults`` this process's armed faults (what :func:`armed` returns)."""
    global _armed
    _armed = Injector(faults, run_dir)
    return _armed


def armed() -> Injector:
    """The armed faults: a trainer's here, else those of $CORUN_FAULTS, else none."""
    global _armed
    if _armed is None:
        spec = os.environ.get(ENV, "")
        _armed = Injector(msgspec.json.decode(spec, type=list[Fault]) if spec else [])
    return _armed


def release_all() -> None:
    """End every hang (their threads return) and disarm."""
    global _armed
    for injector in _injectors:
        injector.released.set()
    _injectors.clear()
    _armed = None
    with _fired_lock:
        _fired.clear()


def spec(*faults: Fault) -> list[dict[str, Any]]:
    """Faults as a config value (``trainer.faults``; ``json.dumps`` it for $CORUN_FAULTS)."""
    return [msgspec.to_builtins(f) for f in faults]


# ----------------------------------------------------------------------------- parts


class FaultyData:
    """A data source whose ``batch`` fails, or is slow, on command (phase ``data``)."""

    def __init__(self, inner: corun.Dataset, injector: Injector) -> None:
        self.inner, self.injector = inner, injector

    def batch(self, index: int) -> Any:
        self.injector.hit("data")
        return self.inner.batch(index)


class CheckpointFault:
    """Put in a trainer's state dict, it makes the real checkpoint write (torch.save, in
    checkpoint.write) fail with a full disk, or take longer (phase ``checkpoint``); it
    is written as an empty tensor."""

    def __init__(self, injector: Injector) -> None:
        self.injector = injector

    def __reduce_ex__(self, protocol: Any) -> Any:
        fault = self.injector.due("checkpoint")
        if fault is not None and fault.action == "raise":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if fault is not None and fault.action == "hang":
            self.injector.block()
        elif fault is not None:
            time.sleep(fault.slow_s)
        return torch.zeros(0).__reduce_ex__(protocol)


def with_checkpoint_fault(state: dict[str, Any], injector: Injector) -> dict[str, Any]:
    if any(f.phase == "checkpoint" for f in injector.faults):
        return {**state, "fault": CheckpointFault(injector)}
    return state


class FaultyEngine(EngineWrapper):
    """An :class:`Engine` (the real one inside) that fails, hangs or slows down on
    command: ``generate``, ``sync`` (update_weights) and ``engine_shutdown``. Hangs
    block the real engine's lane, where its compute runs."""

    def __init__(self, inner: Engine, injector: Injector) -> None:
        super().__init__(inner)
        self.injector = injector
        lane = getattr(inner, "lane", None)
        self.lane: Lane = lane if isinstance(lane, Lane) else Lane("faulty-engine")

    async def generate(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int
    ) -> list[Generation]:
        await self.injector.ahit("generate", self.lane, EngineError)
        return await self.inner.generate(prompts, sampling, seed)

    async def update_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        await self.injector.ahit("sync", self.lane, EngineError)
        await self.inner.update_weights(state, version)

    async def shutdown(self) -> None:
        try:
            await self.injector.ahit("engine_shutdown", self.lane, EngineError)
        finally:
            await self.inner.shutdown()


class SkipReload(EngineWrapper):
    """An :class:`Engine` whose weight updates return without loading anything: a sync
    that silently did not take, which corun/engines/fingerprint.py's ``sync_verified``
    must catch (the engine's fingerprint stays that of its old weights)."""

    def __init__(self, inner: Engine) -> None:
        super().__init__(inner)
        self.skipped: list[int] = []  # the versions it did not load

    async def update_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        self.skipped.append(version)


class FaultyEnv:
    """An :class:`Environment` whose ``step`` fails, hangs or slows down (phase ``env``)."""

    def __init__(self, inner: Environment, injector: Injector) -> None:
        self.inner, self.injector = inner, injector

    async def reset(self, task: Any) -> str:
        return await self.inner.reset(task)

    async def step(self, reply: str) -> Step:
        await self.injector.ahit("env")
        return await self.inner.step(reply)


def reward(*, response: str, **_: Any) -> float:
    """A reward function (``"tests.support.faults:reward"``) with the ``reward`` fault point:
    the share of letters in the reply (dense: a random model's groups have a spread)."""
    armed().hit("reward")
    return sum(c.isascii() and c.isalpha() for c in response) / max(1, len(response))


# ----------------------------------------------------------------------------- kinds


class FaultyFakeConfig(FakeConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    faults: list[Fault] = msgspec.field(default_factory=list)


class FaultyFake(FakeTrainer):
    """tests/support/fakes.py's trainer (plain hooks, run on lanes) with fault points."""

    Config = FaultyFakeConfig  # type: ignore[assignment]
    config: FaultyFakeConfig  # type: ignore[assignment]

    def setup(self, ctx: corun.SetupContext) -> None:
        self.faults = arm(self.config.faults, self.run_config.run_dir)
        super().setup(ctx)

    def dataset(self) -> corun.Dataset:
        return FaultyData(super().dataset(), self.faults)

    def sync_weights(self, version: int) -> None:
        self.faults.hit("sync")  # on the train lane: a hang blocks its thread
        super().sync_weights(version)

    def _evaluate(self, step: int) -> dict[str, float]:
        self.faults.hit("eval")
        return super()._evaluate(step)

    def state_dict(self) -> dict[str, Any]:
        return with_checkpoint_fault(super().state_dict(), self.faults)


class FaultyGRPOConfig(HFGRPOConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    faults: list[Fault] = msgspec.field(default_factory=list)


class FaultyGRPO(HFGRPOTrainer):
    """``hf_grpo`` (local engine) with fault points in its engine and its other parts."""

    Config = FaultyGRPOConfig

    async def setup(self, ctx: corun.SetupContext) -> None:  # type: ignore[override]
        self.faults = arm(self.config.faults, self.run_config.run_dir)
        await super().setup(ctx)

    async def wrap_engine(self, engine: Engine) -> Engine:
        faulty = FaultyEngine(engine, self.faults)
        await self.faults.ahit("engine_start", faulty.lane, EngineError)
        return faulty

    def dataset(self) -> corun.Dataset:
        return FaultyData(super().dataset(), self.faults)

    async def evaluate(self) -> dict[str, float]:
        await self.faults.ahit("eval")
        return await super().evaluate()

    def state_dict(self) -> dict[str, Any]:
        return with_checkpoint_fault(super().state_dict(), self.faults)


class FaultyAgenticConfig(AgenticConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    faults: list[Fault] = msgspec.field(default_factory=list)


class FaultyAgentic(AgenticGRPOTrainer):
    """``agentic`` whose training environments fail, hang or slow down (phase ``env``)."""

    Config = FaultyAgenticConfig

    def setup(self, ctx: corun.SetupContext) -> None:
        self.faults = arm(self.config.faults, self.run_config.run_dir)
        super().setup(ctx)

    def make_env(self, index: int, row: int, settings: EnvSettings) -> Environment:
        env = super().make_env(index, row, settings)
        return env if index < 0 else FaultyEnv(env, self.faults)  # not the held-out ones
