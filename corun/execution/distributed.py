"""Data-parallel training under torchrun: the world, the rank's share of each batch,
and the collectives of an update, each bounded by ``run.collective_timeout_s``.

corun keeps every rank's trainer whole (no DDP wrapper): each rank builds the same
model from the same seed, trains on its shard of every step's rollout batch, and the
update protocol (corun/loop/update.py) averages the gradients over the ranks before
clipping, in one flattened all-reduce per optimizer step. So the weights and the
optimizer state stay replicated, and rank 0's state is the whole state: its
checkpoint loads at any world size. What the ranks do differently:

- **data**: rank ``r`` of ``W`` rolls out the ``r``-th of ``W`` contiguous, near-equal
  slices of each data batch (:class:`ShardedData`; the batch must be a sequence, or
  a batch of rows with ``len`` and ``rows(slice)``; ``data.batch_size`` a multiple
  of ``W``);
- **randomness**: its rollouts draw from generators seeded by (:func:`rank_seed` of
  the run seed and ``r``, index, attempt), so ranks do not repeat each other's draws;
  at world size 1 nothing changes;
- **records**: only rank 0 writes to the run directory (see corun/host/cli.py).

A loss that averages over tokens divides by :func:`shared_count` of its local count
(the count over all ranks / ``W``), so the mean of the ranks' gradients is the
gradient of the global token mean; a statistic of the whole batch (PPO's advantage
whitening) comes from :func:`shared_mean_std`. A collective that does not complete within the
timeout, or whose peer is gone, raises :class:`CollectiveError` (one line); a stop
(Ctrl-C) while waiting abandons the wait at once, before anything was applied.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import msgspec
import torch
import torch.distributed as dist

from corun.base.config import Config
from corun.base.errors import ConfigError
from corun.base.rng import stable_seed
from corun.execution import device
from corun.execution.compute import cancel_point, in_lane_call, stop_requested

# The kinds that opt in (``data_parallel = True``), for the refusal's message.
SUPPORTED = (
    "sft, grpo, ppo, agentic_sft, agentic, agentic_ppo, hf_sft, hf_grpo, hf_ppo, "
    "flow_pretrain, flow_grpo, pe_warmup, pe, unified_pretrain, unified"
)
_POLL_S = 0.0005  # how often a pending collective is checked (and a stop noticed)
_PR_SET_PDEATHSIG = 1
# How long a rank whose peer vanished waits for its own stop request before it calls
# the vanishing an error (the launcher signals every rank at once).
_STOP_GRACE_S = 2.0


class CollectiveError(RuntimeError):
    """A collective failed: a rank died, hangs past the timeout, or the group broke."""


class PeerStopped(CollectiveError):
    """A peer left during a collective that cannot be abandoned (a step was applied),
    and this rank was asked to stop too: Ctrl-C reaching the ranks one after another."""


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def parallel(self) -> bool:
        return self.size > 1

    @property
    def writes(self) -> bool:
        """Whether this rank owns the run directory (logging, events, checkpoints)."""
        return self.rank == 0


def world() -> World:
    """This process's place in the torch.distributed group (0 of 1 outside one)."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return World()


def launched_size() -> int:
    """The world size torchrun started this process in (0: not under torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "0"))


def backend() -> str:
    """NCCL where the run's device is a GPU (gradients live there), gloo on the CPU."""
    return "nccl" if device.current().type == "cuda" else "gloo"


def init(timeout_s: float, device_setting: str = "auto") -> World:
    """Join the process group torchrun set up (env://) on the run's device (each rank
    its local GPU, or the CPU), collectives bounded by ``timeout_s``."""
    _die_with_parent()
    device.use(device_setting)
    dist.init_process_group(backend(), timeout=timedelta(seconds=timeout_s))
    _timeout_s[0] = timeout_s
    # Checkpoint writes run in the background beside training: their collectives get a
    # group of their own, so the two never interleave on one group.
    _groups["checkpoint"] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return world()


def share_run_dir(path: Path) -> None:
    """Record the run directory (rank 0's) for this rank's sharded checkpoint writes:
    a rank's other records go to a scratch directory of its own."""
    _groups["run_dir"] = path


def check_shared(run_dir: Path) -> None:
    """Across nodes, every rank reads and writes the run directory (checkpoint shards,
    the resume point): refuse, on every rank at once, a directory some node does not
    share. Rank 0 writes a marker there; each rank reports whether it sees it."""
    if not _across_nodes():  # one node: one filesystem
        return
    size = world().size
    group = _groups["checkpoint"]  # gloo: plain Python objects
    marker = run_dir / f".corun-nodes-{secrets.token_hex(6)}"
    made = [""]
    if world().rank == 0:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            marker.write_text(socket.gethostname())
            made[0] = marker.name
        except OSError as exc:
            made[0] = f"!cannot write there ({exc.strerror})"
    dist.broadcast_object_list(made, src=0, group=group)
    if made[0].startswith("!"):
        raise ConfigError(f"`$.run.dir` = {str(run_dir)!r}: {made[0][1:]}")
    seen: list[tuple[int, str, bool]] = [(0, "", True)] * size
    node = int(os.environ.get("GROUP_RANK", "0"))
    mine = (node, socket.gethostname(), (run_dir / made[0]).exists())
    dist.all_gather_object(seen, mine, group=group)
    dist.barrier(group=group)
    if world().rank == 0:
        (run_dir / made[0]).unlink(missing_ok=True)
    blind = sorted({(n, host) for n, host, sees in seen if not sees})
    if blind:
        node, host = blind[0]
        raise ConfigError(
            f"`$.run.dir` = {str(run_dir)!r}: node {node} ({host}) does not see what node 0 "
            "writes there; every node needs it on a filesystem they share (NFS, Lustre, a "
            "cluster's shared home), at the same path"
        )


def _across_nodes() -> bool:
    size = world().size
    return size > int(os.environ.get("LOCAL_WORLD_SIZE", size))


def follow_stops() -> None:
    """Across nodes, a signal reaches one node's ranks (its launcher's): each rank
    watches the rendezvous store for a stop another node's rank announced
    (:func:`announce_stop`) and stops as if it had received the signal itself."""
    if not _across_nodes():
        return
    store = dist.TCPStore(  # type: ignore[attr-defined]  # public, not re-exported
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timedelta(seconds=30), wait_for_workers=False,
    )  # fmt: skip
    _groups["stop_store"] = store
    node = os.environ.get("GROUP_RANK", "0")

    def watch() -> None:
        while not _stopping.is_set():
            try:
                if store.check([_STOP_KEY]):
                    signum, origin = store.get(_STOP_KEY).decode().split()
                    if origin != node and not _stopping.is_set():
                        _stopping.set()
                        os.kill(os.getpid(), int(signum))
                    return
            except Exception:  # the store is gone (node 0 ended): nothing more to follow
                return
            time.sleep(0.2)

    threading.Thread(target=watch, name="corun-stop-follower", daemon=True).start()


def announce_stop(signum: int) -> None:
    """This rank's first stop signal: the other nodes' ranks stop too (the first
    announcement stands; a rank that follows one does not announce again)."""
    if _stopping.is_set():
        return
    _stopping.set()
    store = _groups.get("stop_store")
    if store is not None:
        try:
            store.compare_set(_STOP_KEY, "", f"{signum} {os.environ.get('GROUP_RANK', '0')}")
        except Exception:  # the store is gone: the other nodes have ended
            pass


def shared_run_dir() -> Path | None:
    """The run directory every rank writes its checkpoint shards into (None: this
    process's own run directory)."""
    found = _groups.get("run_dir")
    return found if isinstance(found, Path) else None


def checkpoint_group() -> Any:
    """The process group of sharded checkpoint writes and reads (gloo, on every rank)."""
    return _groups.get("checkpoint")


def finish(clean: bool) -> None:
    """Leave the group after a clean run (an interrupted rank may have a collective
    pending that its peers abandoned: the process just exits)."""
    if clean and dist.is_initialized():
        dist.destroy_process_group()


def _die_with_parent() -> None:
    """SIGTERM this rank when its launcher (torchrun's agent) dies, even by SIGKILL: a
    rank runs in a session of its own, which no group kill of the launcher reaches."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the collective timeout still applies
        pass


# ----------------------------------------------------------------------------- refusals


def check_supported(trainer: Any, config: Config, size: int) -> None:
    """Refuse, with one line, a run that cannot train data-parallel at ``size`` ranks."""
    kind = config.trainer.kind
    if not getattr(trainer, "data_parallel", False):
        raise ConfigError(
            f"`$.trainer.kind` = {kind!r} does not support data-parallel training yet "
            f"({size} processes); supported: {SUPPORTED} — run it with run.nproc = 1"
        )
    if config.data.batch_size % size:
        raise ConfigError(
            f"`$.data.batch_size` = {config.data.batch_size} does not split evenly over "
            f"{size} processes"
        )
    if config.run.parallel == "fsdp" and not getattr(trainer, "shards_model", False):
        raise ConfigError(
            f'`$.run.parallel` = "fsdp": `$.trainer.kind` = {kind!r} does not shard its '
            'model (shards_model); every built-in kind does — use run.parallel = "ddp"'
        )
    if config.loop.concurrency > 1:
        raise ConfigError(
            f"`$.loop.concurrency` = {config.loop.concurrency}: data-parallel training is "
            "synchronous for now (concurrency = 1)"
        )
    if config.serve.enabled:
        raise ConfigError("`$.serve.enabled`: no endpoint in data-parallel training")
    if list(trainer.prerequisites()):
        raise ConfigError(
            "a prerequisite run (init_from = a config) is trained with run.nproc = 1 first"
        )


# ----------------------------------------------------------------------------- data


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s rollout generators."""
    return stable_seed("rank", seed, rank)


def rollout_config(config: Config, w: World | None = None) -> Config:
    """What the rollout producer reads: the rank's own rollout seed at world size > 1."""
    w = w or world()
    if not w.parallel:
        return config
    replace = msgspec.structs.replace
    return replace(config, run=replace(config.run, seed=rank_seed(config.run.seed, w.rank)))


@runtime_checkable
class Rows(Protocol):
    """A batch of rows that is not a sequence (tensors side by side): its row count and
    the batch of some of its rows."""

    def __len__(self) -> int: ...

    def rows(self, rows: slice) -> Any: ...


def shard(items: Any, rank: int, size: int) -> Any:
    """The ``rank``-th of ``size`` contiguous near-equal slices of ``items`` (a sequence,
    or :class:`Rows`)."""
    part, extra = divmod(len(items), size)
    start = rank * part + min(rank, extra)
    rows = slice(start, start + part + (rank < extra))
    return items[rows] if isinstance(items, Sequence) else items.rows(rows)


class ShardedData:
    """A dataset whose batch ``i`` is this rank's slice of the inner batch ``i``."""

    def __init__(self, inner: Any, w: World) -> None:
        self.inner = inner
        self.world = w
        self.in_memory = getattr(inner, "in_memory", False)  # corun/contract/data.py

    def batch(self, index: int) -> Any:
        items = self.inner.batch(index)
        if not isinstance(items, Sequence | Rows):
            raise TypeError(
                f"data-parallel training slices each data batch by rank; batch {index} is a "
                f"{type(items).__name__}, not a sequence (or rows with rows(slice))"
            )
        return shard(items, self.world.rank, self.world.size)


def sharded(dataset: Any, w: World | None = None) -> Any:
    w = w or world()
    return ShardedData(dataset, w) if w.parallel else dataset


# ----------------------------------------------------------------------------- collectives

_timeout_s = [300.0]
_groups: dict[str, Any] = {}
_STOP_KEY = "corun/stop"  # in the rendezvous store: "<signal number> <node>"
_stopping = threading.Event()  # this rank got (or followed) a stop signal
_local = threading.local()


@contextmanager
def uncancellable() -> Iterator[None]:
    """Collectives in here are not abandoned on a stop (an optimizer step was applied)."""
    _local.uncancellable = True
    try:
        yield
    finally:
        _local.uncancellable = False


def take_collective_s() -> float:
    """Seconds this thread waited in collectives since the last call."""
    spent = getattr(_local, "spent_s", 0.0)
    _local.spent_s = 0.0
    return float(spent)


def all_reduce_sum(tensor: torch.Tensor, what: str) -> None:
    """Sum ``tensor`` over the ranks in place, within the timeout, abandoned on a stop."""
    _all_reduce(tensor, what, dist.ReduceOp.SUM)


def all_reduce_max(tensor: torch.Tensor, what: str) -> None:
    """The ranks' elementwise maximum of ``tensor``, in place (as :func:`all_reduce_sum`)."""
    _all_reduce(tensor, what, dist.ReduceOp.MAX)


def _all_reduce(tensor: torch.Tensor, what: str, op: Any) -> None:
    started = time.monotonic()
    try:
        work = dist.all_reduce(tensor, op=op, async_op=True)
        assert work is not None
        deadline = started + _timeout_s[0]
        uncancellable = getattr(_local, "uncancellable", False)
        while not work.is_completed():
            if not uncancellable:
                cancel_point()  # a stop while waiting: nothing has been applied yet
            elif stop_requested():
                # A peer that saw the stop first abandoned the step before this
                # collective and never posts it: wait out the grace, not the timeout.
                deadline = min(deadline, time.monotonic() + _STOP_GRACE_S)
                if time.monotonic() > deadline:
                    raise PeerStopped(_message(what, "a peer stopped first"))
            if time.monotonic() > deadline:
                raise CollectiveError(_message(what, f"no reply within {_timeout_s[0]:g} s"))
            time.sleep(_POLL_S)
        work.wait()
    except (RuntimeError, dist.DistError) as exc:
        if isinstance(exc, CollectiveError):
            raise
        _stop_grace(what)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CollectiveError(_message(what, first)) from None
    finally:
        _local.spent_s = getattr(_local, "spent_s", 0.0) + time.monotonic() - started


# What torch's collectives raise when a peer is gone: gloo's and NCCL's errors reach
# Python as RuntimeErrors (or DistErrors) whose message names the transport.
_PEER_GONE = ("gloo", "nccl", "connection closed by peer", "processgroup", "connection reset")


@contextmanager
def collective_failures(what: str) -> Iterator[None]:
    """Collectives inside that torch runs itself (FSDP2's gathers and reductions) fail
    as :func:`all_reduce_sum`'s do: one line naming ``what``, after the stop grace (a
    peer that stopped first on Ctrl-C is an interrupt, not an error)."""
    try:
        yield
    except (RuntimeError, dist.DistError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if isinstance(exc, CollectiveError) or not (
            isinstance(exc, dist.DistError) or any(s in first.lower() for s in _PEER_GONE)
        ):
            raise
        _stop_grace(what)
        raise CollectiveError(_message(what, first)) from None


def _stop_grace(what: str) -> None:
    """After a peer vanished, wait briefly for this rank's own stop: on Ctrl-C every rank
    gets the signal, and a peer that stopped first must not make this rank's stop read
    as an error. Raises the lane's cancellation if the stop arrives in time, or, where
    a step was applied and the call must complete, :class:`PeerStopped`."""
    if not in_lane_call():
        return  # inline compute: the loop sees its stop only after this call returns
    uncancellable = getattr(_local, "uncancellable", False)
    deadline = time.monotonic() + _STOP_GRACE_S
    while time.monotonic() < deadline:
        if not uncancellable:
            cancel_point()
        elif stop_requested():
            raise PeerStopped(_message(what, "a peer stopped first"))
        time.sleep(0.01)


def _message(what: str, why: str) -> str:
    return (
        f"rank {dist.get_rank()}: {what} failed ({why}): a rank died or hangs; "
        "see run.collective_timeout_s"
    )


def shared_count(count: torch.Tensor) -> torch.Tensor:
    """What a local mean divides by so that the mean of the ranks' gradients is the
    global mean: the count over all ranks / the world size (``count`` itself at world
    size 1). A collective: every rank calls it the same number of times."""
    w = world()
    if not w.parallel:
        return count
    total = count.detach().to(torch.float64).reshape(1).clone()
    all_reduce_sum(total, "token count all-reduce")
    return (total / w.size).to(count.dtype if count.is_floating_point() else torch.float32)[0]


def shared_mean_std(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and the unbiased std of the 1-D ``values`` over every rank's values, for a
    statistic of the whole batch (PPO's advantage whitening): ``values.mean()`` and
    ``values.std()`` at world size 1. Collectives: every rank calls it the same number of
    times."""
    if not world().parallel:
        return values.mean(), values.std()
    wide = values.detach().to(torch.float64)
    sums = torch.stack([torch.tensor(float(wide.numel()), dtype=torch.float64), wide.sum()])
    all_reduce_sum(sums, "statistics all-reduce")
    mean = sums[1] / sums[0]
    squares = (wide - mean).square().sum().reshape(1)
    all_reduce_sum(squares, "statistics all-reduce")
    std = (squares[0] / (sums[0] - 1)).sqrt()
    return mean.to(values.dtype), std.to(values.dtype)


def average_gradients(params: Sequence[torch.nn.Parameter]) -> None:
    """Replace each gradient by its mean over the ranks (DDP's semantics), in one
    all-reduce per dtype. A parameter without a gradient on every rank keeps none."""
    size = world().size
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    for group in by_dtype.values():
        present = torch.tensor([float(p.grad is not None) for p in group], dtype=group[0].dtype)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group]
        flat = torch.cat([present, *(g.reshape(-1) for g in grads)])
        all_reduce_sum(flat, "gradient all-reduce")
        flat /= size
        anywhere = flat[: len(group)].tolist()
        offset = len(group)
        for p, g, had in zip(group, grads, anywhere, strict=True):
            n = g.numel()
            if had > 0:
                p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n


def mean_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """Each value averaged over the ranks (every rank logs the same keys); timings
    (``perf/``) stay this rank's."""
    keys = sorted(k for k in metrics if not k.startswith("perf/"))
    if not keys or not world().parallel:
        return dict(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    try:
        all_reduce_sum(values, "metrics all-reduce")
    except PeerStopped:  # stopping anyway: the step is booked with this rank's own values
        return dict(metrics)
    values /= world().size
    return {**metrics, **dict(zip(keys, values.tolist(), strict=True))}
