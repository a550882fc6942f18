"""The trainer contract: the few methods the runtime calls.

A trainer subclasses :class:`Trainer` and overrides only where its algorithm
differs; every hook has a default, and the runtime skips hooks left at their
default (no thread hop, no event). Hooks may be plain functions, which the runtime
runs on a compute lane (a worker thread), or ``async def``, which run on the event
loop (engines behind HTTP, say) and offload their own compute.

Failure policy: training hooks (setup, rollout, train_step, sync_weights, evaluate*,
state_dict) propagate; the run stops and tears down. ``on_train_end`` runs last on
every exit path.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from corun.config import Config as CorunConfig
from corun.config import TrainerConfig
from corun.data import Dataset, IndexData
from corun.errors import ConfigError

Metrics = Mapping[str, "float | Image"]  # numbers, and images such as sample grids
C = TypeVar("C", bound=TrainerConfig)

ENTRY_POINT_GROUP = "corun.trainers"


@dataclass
class Batch:
    """One rollout batch. The runtime fills ``version`` (weights it was made with),
    ``step`` (its data index) and, with ``loop.accumulate``, its place in the window."""

    data: Any
    metrics: Mapping[str, float] = field(default_factory=dict)
    version: int = -1
    step: int = -1
    window_pos: int = 0  # 0 .. window_size - 1: which train_step of the window this is
    window_size: int = 1

    @property
    def ends_window(self) -> bool:
        """Whether ``train_step`` on this batch applies the accumulated update."""
        return self.window_pos == self.window_size - 1


@dataclass(frozen=True)
class Image:
    """An image file as a metric value (e.g. an eval's sample grid): metrics.jsonl
    records its path, wandb (when on) logs the picture."""

    path: Path
    caption: str = ""


@dataclass(frozen=True)
class Outcome:
    """How a run ended, handed to ``on_train_end`` and returned by ``run``."""

    reason: str  # "done" | "interrupted" | "error" | "cancelled"
    step: int
    error: BaseException | None = None
    signal: str | None = None


TeardownFn = Callable[[], Any]


class SetupContext:
    """Handed to ``Trainer.setup``: where resources that need teardown are registered.

    Teardown runs in the reverse order of registration, each step shielded and under
    its own deadline. Register the rollout engine before its weight-sync channel, so
    the channel is closed first.
    """

    def __init__(
        self, config: CorunConfig, register: Callable[[str, TeardownFn], None] | None = None
    ) -> None:
        self.config = config
        self.teardowns: list[tuple[str, TeardownFn]] = []
        self._register = register

    def on_teardown(self, name: str, fn: TeardownFn) -> None:
        """Run ``fn`` (sync or async) at teardown, logged as ``teardown:<name>``.

        Registered at once, so a set-up that fails or is interrupted half-way still
        releases what it had started.
        """
        self.teardowns.append((name, fn))
        if self._register is not None:
            self._register(name, fn)


class Trainer(Generic[C]):
    """Base class of every trainer. ``Config`` is the trainer's own settings Struct."""

    Config: ClassVar[type[TrainerConfig]] = TrainerConfig
    # Whether train_step honours Batch.window_pos/window_size (loop.accumulate > 1):
    # backward on every batch, the optimizer update only on the window's last.
    accumulates: ClassVar[bool] = False

    def __init__(self, config: CorunConfig) -> None:
        self.run_config = config
        self.config: C = config.trainer  # type: ignore[assignment]

    # ---- set-up and data
    def prerequisites(self) -> Sequence[str | Path]:
        """Configs of runs to train (or reuse, when complete) before this one's set-up."""
        return ()

    def setup(self, ctx: SetupContext) -> Awaitable[None] | None:
        """Build models, optimizer, engine; register what needs teardown on ``ctx``."""

    def dataset(self) -> Dataset:
        """Random-access inputs: ``dataset().batch(i)`` feeds ``rollout`` for step ``i``."""
        return IndexData()

    # ---- the step
    def rollout(self, inputs: Any, step: int) -> Batch | Any:
        """Generate, score and compute advantages for one batch (a producer task)."""
        return inputs

    def train_step(self, batch: Batch) -> Metrics | Awaitable[Metrics]:
        """One optimizer update on ``batch`` (with ``loop.accumulate``, one window's
        share of it; the update is applied when ``batch.ends_window``); returns metrics
        such as ``train/loss``."""
        return {}

    def sync_weights(self, version: int) -> Awaitable[None] | None:
        """Publish the trained weights (``version`` optimizer steps) to the rollout engine."""

    # ---- evaluation
    def evaluate(self) -> Metrics | Awaitable[Metrics]:
        return {}

    def evaluate_baseline(self) -> Metrics | Awaitable[Metrics]:
        return self.evaluate()

    def evaluate_periodic(self, step: int) -> Metrics | Awaitable[Metrics]:
        return self.evaluate()

    # ---- observability and end
    def wandb_extra(self) -> dict[str, Any]:
        """Extra keys for the logging run's config."""
        return {}

    def on_train_end(self, outcome: Outcome) -> Awaitable[None] | None:
        """The last hook, called on every exit path."""

    # ---- resume
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: tensors, numbers, strings, lists and dicts only."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def overrides(trainer: Trainer[Any], hook: str) -> bool:
    """Whether ``trainer`` overrides ``hook`` (the runtime skips default hooks)."""
    return getattr(type(trainer), hook) is not getattr(Trainer, hook)


def resolve_trainer(kind: str, where: str = "trainer.kind") -> type[Trainer[Any]]:
    """A registered name (entry point group ``corun.trainers``) or ``"module:Class"``."""
    if ":" in kind:
        module_name, _, attr = kind.partition(":")
        try:
            target: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                target = getattr(target, part)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"{where}: cannot load trainer {kind!r} ({exc})") from None
    else:
        found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
        if kind not in found:
            names = ", ".join(sorted(found)) or "none installed"
            raise ConfigError(
                f"{where}: unknown trainer {kind!r}; registered: {names}, "
                'or give "package.module:Class"'
            )
        target = found[kind].load()
    if not (isinstance(target, type) and issubclass(target, Trainer)):
        raise ConfigError(f"{where}: {kind!r} is not a corun.Trainer subclass")
    return target
