"""Rollout workers as Ray actors (``[rollout] backend = "ray"``).

Each of the run's rollout workers (``loop.workers``; one at ``concurrency = 1``) is a
Ray actor holding the trainer's rollout side: the actor builds the trainer from the
run's config (at ``concurrency = 1``, so its engine is updated in place) and runs
``rollout(inputs, ctx)`` for the (index, attempt, generator seed, version) the
producer assigns. Admission, staleness, ordering and versions stay the producer's
and the clock's (corun/loop/producer.py): a Ray worker is only where a claimed rollout
runs, in place of a compute lane.

Weights: at each publish the driver takes ``trainer.rollout_weights()`` on the train
lane and ``ray.put``s it once; an actor fetches a version from the object store only
when it differs from the one it holds (the reference travels nested in a list, so
Ray does not resolve it on every call). Under the fixed version schedule the
references of the versions the schedule may still ask for are kept; on resume, the
older ones among them come from the trainer's ``scheduled_rollout_weights()`` (the
versions its checkpoint kept), or the run is refused with one line.

Calls: Ray's ``await ref`` needs asyncio, so results are awaited by a thread hop
(``ray.wait`` with a short timeout, so a cancelled call returns within it and no
thread is abandoned) — the same on asyncio and trio.

A dead worker (its actor killed, its process crashed, or a call over
``rollout.call_timeout_s``, after which the actor is killed) is recorded as a
``worker_lost`` event; its batch is redone, same index, attempt and version, on a
live worker (``on_worker_lost = "redo"``), or the run fails with one line
(``"fail"``, or no worker left). An exception the trainer's rollout raises is a
training error, re-raised as it is.

Teardown (step ``rollout_workers``, after ``checkpoints`` and before the trainer's
own ``weight_sync`` and ``engine``): each actor closes its trainer's resources
(bounded), the actors are killed, ``ray.shutdown()``, and a local cluster's process
group and session are stopped (SIGTERM, SIGKILL after 1 s).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Protocol, runtime_checkable

import anyio
import anyio.to_thread
from torch import Tensor

from corun.base.config import Config
from corun.base.errors import ConfigError
from corun.contract.engine import EngineError
from corun.contract.trainer import Batch, RolloutContext, Trainer
from corun.execution.compute import Lane
from corun.loop.clock import Clock
from corun.records.events import EventLog
from corun.scale.ray_cluster import LocalCluster, check_resources, connect

_POLL_S = 0.1  # a cancelled call returns within this
_CLOSE_S = 5.0  # each actor's trainer teardown, at most


@runtime_checkable
class RemoteRollout(Protocol):
    """What a trainer offers for rollouts in other processes."""

    def rollout_weights(self) -> dict[str, Tensor]:
        """The weights ``sync_weights`` publishes (train side, on the train lane)."""
        ...

    def load_rollout_weights(self, state: dict[str, Tensor], version: int) -> None:
        """Put published weights into the rollout engine (rollout side)."""
        ...

    # Optional: ``scheduled_rollout_weights() -> dict[int, dict[str, Tensor]]``, the
    # weights by version kept for the fixed schedule (what a resume needs, above).


class RolloutWorkerLost(EngineError):
    """A Ray rollout worker died and its batch is not redone."""


class RolloutActor:
    """A rollout worker's process: the trainer's rollout side (run as a Ray actor)."""

    def __init__(self, config: Config, cwd: str) -> None:
        import msgspec

        from corun.base.rng import seed_everything
        from corun.contract.registry import resolve_trainer
        from corun.contract.trainer import SetupContext

        try:
            os.chdir(cwd)  # relative paths in the config (init_from) as the driver sees them
        except OSError:
            pass  # another machine
        if cwd not in sys.path:
            sys.path.insert(0, cwd)
        replace = msgspec.structs.replace
        loop = replace(config.loop, concurrency=1, workers=1, max_staleness=None,
                       version_schedule="free", order="start")  # fmt: skip
        self.config = replace(config, loop=loop, serve=replace(config.serve, enabled=False))
        if config.loop.lane_threads:
            import torch

            torch.set_num_threads(config.loop.lane_threads)
        seed_everything(config.run.seed)
        self.trainer: Any = resolve_trainer(config.trainer.kind)(self.config)
        self.ctx = SetupContext(self.config)
        self.trainer.setup(self.ctx)
        self.version = -1

    def ready(self) -> tuple[int, str]:
        """The actor's pid and the id of the Ray node it landed on."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def rollout(
        self, inputs: Any, index: int, attempt: int, version: int, weights: list[Any]
    ) -> Batch:
        from corun.base.rng import rollout_generator

        if version != self.version:
            import ray

            self.trainer.load_rollout_weights(ray.get(weights[0]), version)
            self.version = version
        ctx = RolloutContext(
            index, rollout_generator(self.config.run.seed, index, attempt), attempt, version
        )
        result = self.trainer.rollout(inputs, ctx)
        batch = result if isinstance(result, Batch) else Batch(result)
        if batch.version < 0:
            batch.version = version
        return batch

    def close(self) -> None:
        """The trainer's rollout-side resources (its engine), in reverse order."""
        for _, fn in reversed(self.ctx.teardowns):
            fn()


class RayWorkers:
    """The run's Ray rollout workers: started in set-up, stopped by teardown."""

    def __init__(self, trainer: RemoteRollout, config: Config, clock: Clock, events: EventLog,
                 lane: Lane) -> None:  # fmt: skip
        self.trainer = trainer
        self.settings = config.rollout
        self.clock = clock
        self.events = events
        self.lane = lane
        # Versions a scheduled rollout may still ask for (one under the free schedule).
        fixed = config.loop.version_schedule == "fixed"
        self._keep = config.loop.staleness_bound + 1 if fixed else 1
        self._refs: dict[int, Any] = {}
        self.actors: list[Any] = []
        self.pids: list[int] = []
        self._dead: set[int] = set()
        self.cluster: LocalCluster | None = None
        self._connected = False

    @classmethod
    async def start(cls, trainer: Trainer[Any], config: Config, num_workers: int,
                    clock: Clock, events: EventLog, lane: Lane) -> RayWorkers:  # fmt: skip
        """Connect (or start a local cluster), start the actors, publish the weights
        (the run's remote rollouts: corun/loop/extensions.py; assembled by corun/host/runs.py)."""
        import inspect

        if not isinstance(trainer, RemoteRollout) or inspect.iscoroutinefunction(trainer.rollout):
            raise ConfigError(
                f'`$.rollout.backend` = "ray": trainer {type(trainer).__name__} needs a '
                "blocking rollout, rollout_weights() and load_rollout_weights(state, version)"
            )
        if getattr(config.trainer, "inflight_at_sync", "drain") == "interrupt":
            raise ConfigError(
                '`$.trainer.inflight_at_sync` = "interrupt": a Ray worker finishes each '
                'rollout on the weights it started with; use "drain"'
            )
        workers = cls(trainer, config, clock, events, lane)
        try:
            await workers._start(config, num_workers)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await workers.stop()
            raise
        return workers

    async def _start(self, config: Config, num_workers: int) -> None:
        started = time.monotonic()
        scheduled = self._scheduled_weights()  # refused before any Ray process starts
        self._connected = True  # from here on, stop() disconnects (ray.shutdown is safe)
        await anyio.to_thread.run_sync(connect, self.settings, num_workers, self._own)
        import ray
        import ray.exceptions as rex

        check_resources(self.settings)  # a placement no node offers would wait forever
        actor_cls = ray.remote(RolloutActor).options(
            num_cpus=self.settings.actor_cpus, resources=self.settings.resources,
            max_restarts=0, max_concurrency=1,
        )  # fmt: skip
        self.actors = [actor_cls.remote(config, os.getcwd()) for _ in range(num_workers)]
        try:
            ready = await self._get_all([actor.ready.remote() for actor in self.actors])
        except (rex.RayError, TimeoutError) as exc:
            first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise RolloutWorkerLost(f"a Ray rollout worker did not start: {first}") from None
        self.pids = [pid for pid, _ in ready]
        for version, weights in scheduled.items():
            await self.publish(version, weights)
        await self.publish(self.clock.published)
        fields: dict[str, Any] = {"pids": self.pids, "nodes": [node for _, node in ready]}
        if self.cluster is not None:  # its session holds every process Ray started
            fields["cluster_pid"] = self.cluster.child.pid
        self.events.emit("rollout_workers", self.clock.step, workers=num_workers,
                         duration_s=round(time.monotonic() - started, 3), **fields)  # fmt: skip

    def _own(self, cluster: LocalCluster) -> None:
        self.cluster = cluster

    def _scheduled_weights(self) -> dict[int, dict[str, Tensor]]:
        """The versions older than the published one that the fixed schedule still asks
        for (a resumed run's first slots), with their weights."""
        clock, wanted, slot = self.clock, set[int](), self.clock.slots
        while clock.fixed_schedule and (version := clock.scheduled_version(slot)) < clock.published:
            wanted.add(version)
            slot += 1
        kept: dict[int, dict[str, Tensor]] = {}
        if wanted:
            kept = getattr(self.trainer, "scheduled_rollout_weights", dict)()
        if missing := sorted(wanted - kept.keys()):
            raise ConfigError(
                f'`$.loop.version_schedule` = "fixed" on Ray workers: resuming needs the '
                f"weights of versions {missing}, which {type(self.trainer).__name__} does not "
                "keep (scheduled_rollout_weights()); resume on thread workers"
            )
        return {version: kept[version] for version in sorted(wanted)}

    async def publish(self, version: int, weights: dict[str, Tensor] | None = None) -> None:
        """Put ``version``'s weights (default: the trainer's current ones) in the object
        store (once; actors fetch them)."""
        import ray

        def put() -> Any:
            return ray.put(self.trainer.rollout_weights() if weights is None else weights)

        self._refs[version] = await self.lane.run(put)
        for old in sorted(self._refs)[: -self._keep]:
            del self._refs[old]

    async def rollout(self, worker: int, inputs: Any, ctx: RolloutContext, version: int) -> Batch:
        """``ctx``'s rollout on worker ``worker``'s actor, or another live one if it died."""
        import ray.exceptions as rex

        weights = [self._refs[version]]
        while True:
            actor = self._live_actor(worker, ctx.index)
            ref = self.actors[actor].rollout.remote(inputs, ctx.index, ctx.attempt, version,
                                                    weights)  # fmt: skip
            try:
                batch: Batch = await self._get(ref, self.settings.call_timeout_s)
                return batch
            except (rex.RayActorError, rex.GetTimeoutError, rex.ObjectLostError) as exc:
                self._lost(actor, ctx.index, exc)

    def _live_actor(self, worker: int, index: int) -> int:
        live = [i for i in range(len(self.actors)) if i not in self._dead]
        if not live:
            raise RolloutWorkerLost(
                f"every Ray rollout worker died; batch {index} cannot be generated"
            )
        return worker if worker in live else live[worker % len(live)]

    def _lost(self, actor: int, index: int, exc: BaseException) -> None:
        import ray

        self._dead.add(actor)
        action = self.settings.on_worker_lost
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        self.events.emit("worker_lost", self.clock.step, worker=actor, pid=self.pids[actor],
                         index=index, error=error, action=action)  # fmt: skip
        ray.kill(self.actors[actor], no_restart=True)  # a hung one too
        if action == "fail":
            raise RolloutWorkerLost(
                f"Ray rollout worker {actor} (pid {self.pids[actor]}) died during batch {index} "
                f'({type(exc).__name__}); `$.rollout.on_worker_lost` = "fail"'
            ) from None

    async def _get(self, ref: Any, timeout_s: float) -> Any:
        """``ray.get(ref)`` off the loop, polled so that cancellation is prompt."""
        import ray
        import ray.exceptions as rex

        def wait() -> tuple[bool, Any]:
            ready, _ = ray.wait([ref], timeout=_POLL_S)
            return (True, ray.get(ready[0])) if ready else (False, None)

        deadline = time.monotonic() + timeout_s
        while True:
            done, value = await anyio.to_thread.run_sync(wait)
            if done:
                return value
            if time.monotonic() > deadline:
                raise rex.GetTimeoutError(f"no result within {timeout_s} s")

    async def _get_all(self, refs: list[Any]) -> list[Any]:
        with anyio.fail_after(self.settings.start_timeout_s):
            return [await self._get(ref, self.settings.start_timeout_s) for ref in refs]

    async def stop(self) -> None:
        """Close and kill the actors, ``ray.shutdown()``, stop a local cluster."""
        await anyio.to_thread.run_sync(self._stop_blocking)

    def _stop_blocking(self) -> None:
        import ray

        try:
            if self._connected:
                live = [a for i, a in enumerate(self.actors) if i not in self._dead]
                closing = [actor.close.remote() for actor in live]
                ray.wait(closing, num_returns=len(closing), timeout=_CLOSE_S)
                for actor in self.actors:
                    try:
                        ray.kill(actor, no_restart=True)
                    except ValueError:  # not an actor handle any more
                        pass
                self._refs.clear()
                ray.shutdown()
                self._connected = False
        finally:
            if self.cluster is not None:
                self.cluster.stop()
                self.cluster = None
