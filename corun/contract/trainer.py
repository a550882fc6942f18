"""The trainer contract: the few methods the runtime calls.

A trainer subclasses :class:`Trainer` and overrides only where its algorithm
differs; every hook has a default, and the runtime skips hooks left at their
default (no thread hop, no event). Hooks may be plain functions, which the runtime
runs on a compute lane (a worker thread), or ``async def``, which run on the event
loop (engines behind HTTP, say) and offload their own compute.

A trainer supplies its math — how a rollout is made (``rollout``) and the loss of a
part of a batch (``loss``) — and registers its optimizers in ``setup``; the runtime
owns the update protocol around the loss (corun/loop/update.py): accumulation windows,
mini-batches, micro-batches, gradient clipping, the optimizer steps and the version
count. Randomness comes from the generators the runtime hands to each rollout and
update (corun/base/rng.py), never from the process-wide RNGs.

Failure policy: training hooks (setup, rollout, prepare, loss, sync_weights,
evaluate*, state_dict) propagate; the run stops and tears down. ``on_train_end``
runs last on every exit path.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch

from corun.base.config import Config as CorunConfig
from corun.base.config import TrainerConfig
from corun.contract.data import Dataset, IndexData
from corun.contract.engine import Engine, SleepingEngine
from corun.contract.episodes import EpisodeInbox
from corun.contract.policy import ServedPolicy
from corun.contract.training_api import TrainingBackend
from corun.execution.compute import Lane


class Spans(Protocol):
    """Where a rollout records spans of its own work (the run's trace.json)."""

    def span(self, name: str, track: str, **args: Any) -> AbstractContextManager[None]: ...


Metrics = Mapping[str, "float | Image"]  # numbers, and images such as sample grids
C = TypeVar("C", bound=TrainerConfig)
T = TypeVar("T")
DEFAULT_OPTIMIZER = "model"  # its gradient norm is logged as train/grad_norm


@dataclass
class Batch:
    """One rollout batch. The runtime fills ``index`` (its data index) and, unless the
    trainer did, ``version`` (the policy version of the weights it was made with)."""

    data: Any
    metrics: Mapping[str, float] = field(default_factory=dict)
    version: int = -1
    index: int = -1
    # The fingerprint of the weights that generated it, as the engine reported them at
    # the sync of ``version`` (corun/engines/fingerprint.py); "" when not known.
    weights: str = ""
    # Set by the update before ``prepare``: whether the token budget splits any part of
    # this batch into chunks (corun/loop/micro_batches.py). A ``prepare`` that lets the
    # first mini-batch compute something from its own forward pass (the proximal
    # log-probs) computes it up front instead when the pass is split.
    split: bool = False


@dataclass(frozen=True)
class RolloutContext:
    """What the runtime hands to ``rollout`` besides the inputs.

    ``generator`` is seeded by (run seed, ``index``, ``attempt``): draw every random
    number of the rollout from it. ``version`` is the policy version to generate with
    under ``loop.version_schedule = "fixed"`` (an older one than the latest, possibly);
    ``None`` means the latest published weights.

    An ``async def`` rollout (one that waits on environments or servers) runs on the
    event loop; it hands its blocking compute (generation) to :meth:`compute`, which
    runs it on the rollout worker's own lane, and may record spans of its own work
    (an episode's turns and waits) with :meth:`span`.
    """

    index: int
    generator: torch.Generator
    attempt: int = 0
    version: int | None = None
    lane: Lane | None = None
    trace: Spans | None = None
    track: str = "producer"  # the rollout worker's trace track

    async def compute(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on this worker's compute lane (inline when there is none)."""
        if self.lane is None:
            return fn(*args)
        return await self.lane.run(fn, *args)

    def span(self, name: str, track: str, **args: Any) -> AbstractContextManager[None]:
        """A trace span on ``track`` (a no-op without a trace)."""
        if self.trace is None:
            return nullcontext()
        return self.trace.span(name, track, **args)


@dataclass(frozen=True)
class Part:
    """Which part of a batch one ``loss`` call covers: micro-batch ``micro`` of
    ``micros`` within mini-batch ``mini`` of ``minis``.

    Each mini-batch is one optimizer step; its micro-batches are backpropagated one at
    a time (to bound memory) and their gradients add up, so a micro-batch's loss is
    its *share* of the mini-batch's loss (e.g. its row-mean × :meth:`share`).
    ``generator`` (seeded by run seed and data index) is for the update's own draws.
    ``version``: the policy version of the weights the window's update starts from
    (tokens sampled at it were sampled by the weights mini-batch 0 computes with).
    """

    mini: int = 0
    minis: int = 1
    micro: int = 0
    micros: int = 1
    generator: torch.Generator | None = None
    version: int = 0
    # The token budget's chunk of this micro-batch (corun/loop/micro_batches.py), for a
    # trainer that reports its rows' lengths: chunk ``chunk`` of ``chunks``, whose rows
    # are ``chunk_rows`` (batch indices, ascending). None: the micro-batch is whole.
    chunk: int = 0
    chunks: int = 1
    chunk_rows: torch.Tensor | None = None

    def mini_rows(self, n: int) -> slice:
        """This mini-batch's rows of a batch of ``n`` rows (near-equal contiguous slices)."""
        return slice(*_split(0, n, self.mini, self.minis))

    def rows(self, n: int) -> Rows:
        """This call's rows of a batch of ``n`` rows: the micro-batch's slice, or the
        indices of its chunk when the token budget split it."""
        if self.chunk_rows is not None:
            return self.chunk_rows
        return slice(*self._bounds(n))

    @property
    def split(self) -> bool:
        """Whether the token budget split this micro-batch into chunks."""
        return self.chunk_rows is not None

    @property
    def last_chunk(self) -> bool:
        return self.chunk == self.chunks - 1

    def share(self, n: int) -> float:
        """This call's rows over its mini-batch's: the weight of a row-mean loss."""
        start, stop = self._bounds(n)
        mini_start, mini_stop = _split(0, n, self.mini, self.minis)
        rows = stop - start if self.chunk_rows is None else self.chunk_rows.numel()
        return rows / max(mini_stop - mini_start, 1)

    def micro_bounds(self, n: int) -> tuple[int, int]:
        """This micro-batch's rows ``start, stop`` (all of its chunks')."""
        return self._bounds(n)

    def _bounds(self, n: int) -> tuple[int, int]:
        return _split(*_split(0, n, self.mini, self.minis), self.micro, self.micros)


# A part's rows of a batch: a contiguous slice, or a chunk's row indices.
Rows = slice | torch.Tensor


def _split(start: int, stop: int, part: int, parts: int) -> tuple[int, int]:
    """Part ``part`` of ``parts`` near-equal ranges of ``start:stop`` (the first ones one
    longer, as ``torch.tensor_split``)."""
    size, extra = divmod(stop - start, parts)
    first = start + part * size + min(part, extra)
    return first, first + size + (part < extra)


@dataclass(frozen=True)
class Image:
    """An image file as a metric value (e.g. an eval's sample grid): metrics.jsonl
    records its path, wandb (when on) logs the picture."""

    path: Path
    caption: str = ""


def is_alert(key: str) -> bool:
    """A metric with an ``alert`` part in its name (``alert/...``, or ``train/alert/...``
    as the update protocol prefixes a loss's metrics) is a warning: logged as any
    metric and, where its value is above 0, also recorded as an ``alert`` event and
    shown on the progress line. Report it on every step (0 when all is well): under
    torchrun the ranks' metrics are averaged key by key."""
    return "alert" in key.split("/")[:-1]


@dataclass(frozen=True)
class Outcome:
    """How a run ended, handed to ``on_train_end`` and returned by ``run``."""

    reason: str  # "done" | "interrupted" | "error" | "cancelled"
    step: int
    error: BaseException | None = None
    signal: str | None = None


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer the runtime steps: its parameters' gradients clipped to a global
    norm of ``grad_clip`` first (0: not clipped; the norm is reported either way)."""

    name: str
    optimizer: torch.optim.Optimizer
    grad_clip: float = 0.0

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


TeardownFn = Callable[[], Any]
# Called with the endpoint's URL once it serves (after set-up): a client to start.
ServingFn = Callable[[str], Awaitable[None]]


class SetupContext:
    """Handed to ``Trainer.setup``: the run's whole config (``config``) and the device
    its models go on (``device``); where a trainer registers its optimizers, the
    resources that need teardown, and extra state the checkpoint must hold.

    Teardown runs in the reverse order of registration, each step shielded and under
    its own deadline. Register the rollout engine before its weight-sync channel, so
    the channel is closed first.
    """

    def __init__(
        self, config: CorunConfig, register: Callable[[str, TeardownFn], None] | None = None,
        device: torch.device | None = None,
    ) -> None:  # fmt: skip
        self.config = config
        # Where the trainer puts its models, optimizer state, batches and losses
        # (run.device, resolved: corun/execution/device.py); rewards and data stay on
        # the CPU.
        self.device = device or torch.device("cpu")
        self.teardowns: list[tuple[str, TeardownFn]] = []
        self.sleepers: list[SleepingEngine] = []  # engines colocated on self.device
        self.optimizers: list[OptimizerSpec] = []
        self.kept: dict[str, Stateful] = {}
        self._register = register
        # The train lane, for async hooks with blocking compute (an agentic evaluation
        # that waits on environments: RolloutContext(..., lane=ctx.lane)); None
        # outside a run (inline).
        self.lane: Lane | None = None
        # Episodes submitted from outside the run (a host's agents, the endpoint's
        # capture) when the run has a source of them: an embedded session, or
        # [serve] enabled; a trainer that trains on them takes from it.
        self.inbox: EpisodeInbox | None = None
        self.serving: list[ServingFn] = []

    def add_optimizer(
        self, optimizer: torch.optim.Optimizer, *, grad_clip: float = 0.0,
        name: str = DEFAULT_OPTIMIZER,
    ) -> None:  # fmt: skip
        """An optimizer the runtime zeroes, clips and steps (in registration order); its
        norm is logged as ``train/grad_norm``, or ``train/<name>/grad_norm`` when named."""
        if any(spec.name == name for spec in self.optimizers):
            raise ValueError(f"an optimizer named {name!r} is registered already")
        self.optimizers.append(OptimizerSpec(name, optimizer, grad_clip))

    def keep_state(self, name: str, component: Stateful) -> None:
        """Save ``component``'s state with every checkpoint and restore it on resume
        (runtime-side pieces such as the rollout weight history of a fixed schedule)."""
        self.kept[name] = component

    def share_device(self, engine: SleepingEngine) -> None:
        """An engine on the trainer's device that sleeps while the trainer steps: the
        template puts it to sleep before each update and wakes it after the step's
        sync (phases ``sleep`` and ``wake``)."""
        self.sleepers.append(engine)

    def on_teardown(self, name: str, fn: TeardownFn) -> None:
        """Run ``fn`` (sync or async) at teardown, logged as ``teardown:<name>``.

        Registered at once, so a set-up that fails or is interrupted half-way still
        releases what it had started.
        """
        self.teardowns.append((name, fn))
        if self._register is not None:
            self._register(name, fn)

    def on_serving(self, fn: ServingFn) -> None:
        """Await ``fn(url)`` once the run's endpoint (``[serve] enabled``) serves at
        ``url``, before the baseline evaluation: the endpoint starts after set-up, so a
        client of it (an agent process) starts here; an error fails the run."""
        self.serving.append(fn)


class Trainer(Generic[C]):
    """Base of every trainer. ``Config`` is the trainer's own settings Struct."""

    Config: ClassVar[type[TrainerConfig]] = TrainerConfig
    # Trains under torchrun (world size > 1): its data batches are sequences the
    # runtime may slice by rank, and every loss that averages over rows or tokens
    # divides by ``corun.shared_count`` of its local count (corun/execution/distributed.py).
    data_parallel: ClassVar[bool] = False
    # ``micro_batches`` splits a mini-batch's rows (``Part.rows``); False: its parts are
    # something else over all of the mini-batch's rows (Flow-GRPO's denoising steps),
    # and the token budget (``row_tokens``) then chunks those rows in every part.
    row_micro_batches: ClassVar[bool] = True

    def __init__(self, config: CorunConfig) -> None:
        self.run_config = config
        self.config: C = config.trainer  # type: ignore[assignment]

    # ---- set-up and data
    def prerequisites(self) -> Sequence[str | Path]:
        """Configs of runs to train (or reuse, when complete) before this one's set-up."""
        return ()

    def setup(self, ctx: SetupContext) -> Awaitable[None] | None:
        """Build models, optimizers (``ctx.add_optimizer``), the rollout engine; register
        what needs teardown on ``ctx``. The global RNGs are seeded with ``run.seed``."""

    def dataset(self) -> Dataset:
        """Random-access inputs: ``dataset().batch(i)`` feeds the rollout of index ``i``."""
        return IndexData()

    # ---- the step
    def rollout(self, inputs: Any, ctx: RolloutContext) -> Batch | Any:
        """Generate, score and compute advantages for one batch (a producer task)."""
        return inputs

    def prepare(self, batch: Batch) -> Any:
        """Per-batch work under the weights the batch is trained from, before its first
        loss (PPO's old values, a proximal policy's log-probs); returns the new
        ``batch.data``."""
        return batch.data

    def micro_batches(self, batch: Batch) -> int:
        """Micro-batches per mini-batch of ``batch``: ``loss`` calls backpropagated one
        at a time into the same gradients (rows, or denoising steps)."""
        return 1

    def row_tokens(self, batch: Batch) -> Sequence[int] | None:
        """The tokens each row of ``batch`` costs a forward pass (its length without
        padding), so the runtime can split a part that is over ``loop.micro_batch_tokens``
        into chunks of rows (``Part.chunk_rows``). None (the default): never split.

        A trainer that reports them takes ``part.rows(n)`` as given (a slice, or a
        chunk's indices), cuts the chunk to its longest row, and returns the chunk's
        *share* of the micro-batch's loss and metrics: sums over its rows divided by the
        whole mini-batch's count (``part.mini_rows``), which the runtime adds up over
        the chunks."""
        return None

    def loss(self, batch: Batch, part: Part) -> tuple[torch.Tensor, Mapping[str, float]]:
        """The loss of ``part`` of ``batch`` (a tensor to backpropagate) and metrics
        (logged as ``train/<name>``, averaged over the calls of a step; a token budget's
        chunks' values are added up first, see :meth:`row_tokens`)."""
        raise NotImplementedError(f"{type(self).__name__} defines neither loss nor train_step")

    def train_step(self, batch: Batch) -> Metrics | Awaitable[Metrics]:
        """Only for a trainer that owns its whole update (no gradients, a test fake):
        overriding it replaces the runtime's protocol around ``loss``, and then
        ``loop.mini_batches`` must be 1. The runtime still counts a version per
        ``loop.accumulate`` steps."""
        raise NotImplementedError

    def sync_weights(self, version: int) -> Awaitable[str | None] | str | None:
        """Publish the trained weights (policy ``version``) to the rollout engine; may
        return the fingerprint of the weights the engine now serves, once verified
        against the trained ones (recorded with the ``sync`` event)."""

    def served_policy(self, lane: Lane) -> ServedPolicy | None:
        """The policy behind the endpoint (``[serve] enabled``): chat rendering, the
        reply format and batched generation from the rollout side's newest weights.
        ``lane`` is the endpoint's own compute lane, for a policy that generates in
        process (an engine-backed policy ignores it)."""
        return None

    def training_backend(self) -> TrainingBackend | None:
        """The models a training-API client creates and drives step by step
        (``serve.tinker``, corun/serve/tinker/): LoRA adapters over this trainer's set-up
        base model. None: this trainer serves no such API."""
        return None

    def rollout_engine(self) -> Engine | None:
        """The set-up trainer's rollout engine, for ``corun engine serve`` to serve to a
        training run's fleet (corun/serve/engine_server.py). None: it has no engine."""
        return None

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


def overrides(trainer: Trainer[Any] | type[Trainer[Any]], hook: str) -> bool:
    """Whether ``trainer`` overrides ``hook`` (the runtime skips default hooks)."""
    cls = trainer if isinstance(trainer, type) else type(trainer)
    return getattr(cls, hook) is not getattr(Trainer, hook)
