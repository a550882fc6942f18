"""Where a model's weights come from and go: rebuilt from a checkpoint, warm-started
from another run (trained first when a config names it), frozen copies (KL anchors,
samplers), and the rollout side's copies (:class:`Replicas`), synced by
:class:`ReplicatedRollouts`; and batches to the run's device (:func:`to_device`)."""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, Protocol, Self, TypeVar, cast

import msgspec
import torch
from torch import Tensor, nn

from corun import CheckpointError, SetupContext, world
from corun.execution import parallel
from corun.records.checkpoint import read_whole
from corun.records.prerequisites import checkpoint_for, is_config

M = TypeVar("M", bound=nn.Module)
R = TypeVar("R")
B = TypeVar("B")
State = dict[str, Tensor]


class Freezable(Protocol):
    """A model, or a policy protocol that nn.Modules satisfy."""

    def eval(self) -> Self: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


F = TypeVar("F", bound=Freezable)


def rebuild(
    model_cls: Callable[[Any], M], config_cls: type[Any], state: dict[str, Any],
    device: torch.device | str = "cpu",
) -> M:  # fmt: skip
    """The model of a trainer ``state_dict()`` (``model_config`` + ``model``) on ``device``.

    Built on the meta device: no init work, and no draws from the global RNG.
    """
    with torch.device("meta"):
        model = model_cls(msgspec.convert(state["model_config"], config_cls))
    model.to_empty(device=device)
    model.load_state_dict(state["model"])
    return model


def to_device(batch: B, device: torch.device | str) -> B:
    """``batch`` (a tensor, or a dataclass of them, nested) with its tensors on ``device``:
    the one copy of a batch built on the CPU to the model's device. Tensors already
    there are kept as they are (a CPU run copies nothing)."""
    device = torch.device(device)
    if isinstance(batch, Tensor):
        moved = batch if batch.device == device else batch.to(device, non_blocking=True)
        return cast(B, moved)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = dataclasses.fields(batch)
        moves = {f.name: to_device(getattr(batch, f.name), device) for f in fields if f.init}
        return cast(B, dataclasses.replace(batch, **moves))
    return batch


def warm_start(init_from: str, load: Callable[[dict[str, Any]], M], what: str) -> M:
    """The model in a checkpoint, given its directory or its run's config; a checkpoint
    of something else is a usage error naming the path."""
    path = checkpoint_for(init_from)
    _, tensors = read_whole(path)
    try:
        return load(tensors["trainer"])
    except (KeyError, TypeError, ValueError, RuntimeError, msgspec.ValidationError) as exc:
        raise CheckpointError(f"{path}: not a {what} checkpoint ({exc})") from None


def warm_start_runs(*init_from: str) -> list[str]:
    """The warm starts among ``init_from`` that name a run's config, not a checkpoint
    directory: a trainer's prerequisites (return them from ``Trainer.prerequisites``),
    trained first when their final checkpoint is missing, in the run directory that
    config names (``run.dir``, else ``runs/<run.name>`` under the working directory)."""
    return [path for path in init_from if is_config(path)]


def frozen_copy(model: F) -> F:
    """A copy in eval mode without gradients."""
    frozen = copy.deepcopy(model).eval()
    for p in frozen.parameters():
        p.requires_grad_(False)
    return frozen


def kl_anchor(model: F, kl_coef: float) -> F | None:
    """What a KL penalty pulls towards: ``model`` as it starts, frozen (on resume too:
    set-up rebuilds it); None when ``kl_coef`` is 0, which skips the reference model."""
    return frozen_copy(model) if kl_coef > 0 else None


class Replicas(Generic[R]):
    """The rollout side's weight copies: ``home`` for the train thread, one per rollout
    worker thread (``loop.concurrency > 1``).

    At concurrency 1 rollouts and training alternate on the train thread, so a sync
    updates ``home`` in place and nothing reads it mid-update. Rollout workers keep
    copies of their own and catch up with a published snapshot before a generation
    (or, for a partial rollout, between decode steps); a snapshot is replaced, never
    modified, so a worker never reads weights half-way through an update. Under the
    fixed version schedule a rollout asks for a given version, so the snapshots the
    schedule may still ask for are kept, and saved with checkpoints.

    ``build`` makes a copy from (weights, version); ``load`` puts other weights in one.
    """

    def __init__(
        self, home: R, build: Callable[[State, int], R], load: Callable[[R, State, int], None],
        *, initial: State, ctx: SetupContext,
    ) -> None:  # fmt: skip
        loop = ctx.config.loop
        self.home = home
        self.version = 0  # of the weights in ``home``
        self._home_thread = threading.get_ident()
        self._build = build
        self._load = load
        # Other threads read the weights: rollout workers, or the policy endpoint.
        self._shared = loop.concurrency > 1 or ctx.config.serve.enabled
        fixed = loop.version_schedule == "fixed"
        # Versions a scheduled rollout may still ask for: at most the staleness bound
        # behind the newest (published versions are at least one apart).
        self._keep = loop.staleness_bound + 1 if fixed else 1
        self._lock = threading.Lock()
        self._history: dict[int, State] = {}
        self._copies: dict[int, tuple[R, int]] = {}
        if self._shared and fixed:
            ctx.keep_state("rollout_weights", self)
        self.publish(initial, 0)

    def sync(self, state: State, version: int) -> None:
        """New trained weights: into ``home`` now, and published for the workers."""
        self._load(self.home, state, version)
        self.version = version
        self.publish(state, version)

    def publish(self, state: State, version: int) -> None:
        if not self._shared:
            return
        snapshot = {key: value.detach().clone() for key, value in state.items()}
        with self._lock:
            self._history[version] = snapshot
            for old in sorted(self._history)[: -self._keep]:
                del self._history[old]

    @property
    def latest(self) -> tuple[int, State]:
        """The newest published (version, weights)."""
        with self._lock:
            version = max(self._history)
            return version, self._history[version]

    def local(self, version: int | None = None) -> tuple[R, int]:
        """The calling thread's copy holding ``version`` (None: the newest), and its version."""
        thread = threading.get_ident()
        if thread == self._home_thread:
            return self.home, self.version
        if version is None:
            version, state = self.latest
        else:
            with self._lock:
                state = self._history[version]
        copy_ = self._copies.get(thread)
        if copy_ is None:
            copy_ = (self._build(state, version), version)
        elif copy_[1] != version:
            self._load(copy_[0], state, version)
            copy_ = (copy_[0], version)
        self._copies[thread] = copy_
        return copy_

    def __len__(self) -> int:
        """Rollout workers holding a copy (the train thread's own not counted)."""
        return len(self._copies)

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {str(version): state for version, state in self._history.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._history = {int(version): weights for version, weights in state.items()}


class ReplicatedRollouts:
    """A trainer whose rollout side is :class:`Replicas` of its trained weights (mixed in
    before its Trainer base): a sync puts ``rollout_weights()`` into them."""

    replicas: Replicas[Any]

    def rollout_weights(self) -> State:
        """The trained weights the rollout side generates with."""
        raise NotImplementedError

    def sync_weights(self, version: int) -> None:
        self.replicas.sync(self.rollout_weights(), version)


def optimizer_state(
    optimizer: torch.optim.Optimizer, modules: Mapping[str, nn.Module]
) -> dict[str, Any]:  # fmt: skip
    """``optimizer``'s state keyed by parameter name (``<module name>.<parameter>``),
    every parameter's state present (a fresh optimizer's is initialised). Sharded
    parameters' state is sharded too, and a checkpoint restores it into another world
    size's shards by these names (corun/records/shards.py)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return dict(get_optimizer_state_dict(nn.ModuleDict(dict(modules)), optimizer))


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, modules: Mapping[str, nn.Module], saved: dict[str, Any]
) -> None:
    """Restore :func:`optimizer_state`; or an older checkpoint's, keyed by position."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if any(isinstance(key, int) for key in saved.get("state", {})):
        optimizer.load_state_dict(saved)
    else:
        set_optimizer_state_dict(nn.ModuleDict(dict(modules)), optimizer, saved)


def whole_copy(model: M) -> M | None:
    """A copy of ``model`` to sample from when it is about to be sharded (world size >
    1): the rollout side holds whole weights. None otherwise (it samples from the
    trained model's own copies)."""
    return copy.deepcopy(model) if world().parallel else None


def gathered_state(model: nn.Module) -> State:
    """``model``'s state dict with whole tensors: gathered from every rank's shards when
    it is sharded (a collective: every rank calls it together), as it is otherwise."""
    state = model.state_dict()
    if not parallel.is_sharded(model):
        return state
    return dict(parallel.GatheredState(state).items())
