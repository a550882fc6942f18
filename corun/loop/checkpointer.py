"""Saving a run: when (after the steps the cadence saves at), what (a snapshot taken
between steps on the train lane), and how (written in the background, drained at
teardown); and resuming one: the restored state loaded into the set-up trainer.

The step loop snapshots the trainer's state and goes on training while the files are
written. A failed write fails the run: the error is recorded, the run is stopped
through its ``RunControl``, and the session raises it after teardown. After an
interrupt, teardown saves once more (``loop.save_on_interrupt``); stopped in the middle
of a window, that save records the window's start, whose weights are still the live
ones (the window's gradients are not state).

Each write is bounded by ``checkpoint.write_timeout_s``: one that overruns — a wedged
disk or network file system — is abandoned in its thread, its temporary files are
removed, and the run fails with one line saying which checkpoint is intact, as after a
full disk. The rename makes each write atomic, so the previous checkpoint stays the
latest (a write that still finishes later, in its abandoned thread, finds its
temporary directory gone and fails there).
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread

from corun.base.config import Config
from corun.base.errors import CheckpointError
from corun.contract.trainer import OptimizerSpec, Outcome, Stateful, Trainer
from corun.execution import distributed
from corun.execution.compute import Lane, blocking_io, call_hook
from corun.loop.cadence import Cadence
from corun.loop.clock import Clock
from corun.loop.kept_rollouts import KeptRollouts
from corun.loop.schedule import horizon
from corun.loop.teardown import RunControl
from corun.records import checkpoint, shards
from corun.records.events import EventLog, Trace


class Checkpointer:
    def __init__(
        self, config: Config, run_id: str, clock: Clock, events: EventLog, trace: Trace,
        control: RunControl, lane: Lane, trainer: Trainer[Any], *, resumed: bool,
    ) -> None:  # fmt: skip
        self.config = config
        self.cadence = Cadence.of(config)
        # Under torchrun every rank's shards go to rank 0's run directory.
        self.run_dir = distributed.shared_run_dir() or config.run_dir
        self.run_id = run_id
        self.clock = clock
        self.events = events
        self.trace = trace
        self.control = control
        self.lane = lane  # where snapshots are taken: between steps, never mid-update
        self.trainer = trainer
        self.kept: dict[str, Stateful] = {}  # what the trainer's set-up registered to keep
        # Finished, untrained rollout batches: kept with each save (checkpoint.keep_rollouts).
        self.rollouts = KeptRollouts(config, clock, events)
        self.last_saved = clock.step if resumed else -1
        self.error: BaseException | None = None
        # Under torchrun rank 0 writes the checkpoint; a state that holds shards
        # (a sharded model's) has every rank write its own shards too
        # (corun/records/shards.py). A replicated state is rank 0's alone.
        self.writes = distributed.world().writes
        self._sharded: bool | None = None  # known at the first save (its snapshot)
        self._pending = 0
        self._done = anyio.Event()
        self._tasks: anyio.abc.TaskGroup | None = None

    def attach(self, tasks: anyio.abc.TaskGroup) -> None:
        """The task group the writes run in: outside the run's cancel scope, so an
        interrupt never cuts a write short (the rename makes each one atomic anyway)."""
        self._tasks = tasks

    async def restore(
        self, state: checkpoint.TrainerState, tensors: Any, optimizers: Iterable[OptimizerSpec]
    ) -> None:
        """Load a checkpoint's tensors into the set-up trainer (its kept components and
        kept rollout batches too); refused with one line if they do not fit."""
        where = checkpoint.resume_point(self.config)
        assert where is not None
        try:
            saved = await self.lane.run(self._fitted, tensors, where)
            await call_hook(self.lane, self.trainer.load_state_dict, saved["trainer"])
            for name, component in self.kept.items():
                component.load_state_dict(saved["kept"][name])
            checkpoint.check_optimizers(spec.optimizer for spec in optimizers)
        except CheckpointError:
            raise
        except Exception as exc:  # torch raises many types for tensors that do not fit
            raise CheckpointError(f"{where}: does not fit this trainer: {exc}") from None
        if state.config_digest != self.config.digest():
            self.events.emit("config_changed", state.step, was=state.config_digest)
        self.events.emit("restore", state.step, version=state.version, cursor=state.data_cursor)
        self.rollouts.restore(tensors.get("rollouts"), state.step)

    def _fitted(self, tensors: Any, path: Path) -> dict[str, Any]:
        """The saved trainer and kept state laid out as this run holds its own: sharded
        tensors read into this rank's shards, whole ones cut to them (blocking; every
        rank calls it)."""
        saved = {"trainer": tensors["trainer"], "kept": tensors.get("kept", {})}
        template = (
            self.state() if distributed.world().parallel or shards.has_sharded(saved) else None
        )
        if template is None:
            return saved
        saved = shards.fill(saved, template, path / shards.SHARDS_DIR)
        return dict(shards.localize(saved, template))

    def state(self) -> dict[str, Any]:
        """What a checkpoint holds (live references; a save snapshots them)."""
        kept = {name: component.state_dict() for name, component in self.kept.items()}
        return {"trainer": self.trainer.state_dict(), "kept": kept}

    async def after(self, step: int) -> None:
        """The save after step ``step``, if the cadence has one there."""
        if self.cadence.saves(step):
            await self.save()

    async def save(self) -> None:
        """Snapshot now (the weights keep training), write in the background."""
        assert self._tasks is not None, "attach() the checkpointer to a task group first"
        kept = self.rollouts.saved()  # here, on the loop: the producer adds to the ledger
        with self.trace.span("snapshot", "trainer"):
            tensors = await self.lane.run(_snapshot, self.state, kept)
        if self._sharded is None:
            self._sharded = shards.has_sharded(tensors)
        if not (self.writes or self._sharded):  # a replicated state: rank 0's to write
            self.last_saved = self.clock.step
            return
        if self._sharded:  # every rank writes its shards in the same order: one at a time
            await self.drain()
        clock = self.clock
        state = checkpoint.TrainerState(
            format=checkpoint.FORMAT_VERSION,
            step=clock.step,
            version=clock.version,
            data_cursor=clock.cursor,
            trained_ahead=sorted(clock.trained_ahead),
            run_id=self.run_id,
            config_digest=self.config.digest(),
            trainer_kind=self.config.trainer.kind,
            lr_horizon=horizon(self.config),
        )
        self.last_saved = clock.step
        path = checkpoint.step_dir(self.run_dir, state.step)
        self.events.emit("save", state.step, path=str(path))
        if kept is not None:
            indexes = [entry["index"] for entry in kept]
            self.events.emit("rollouts_kept", state.step, count=len(kept), indexes=indexes)
        self._pending += 1
        self._done = anyio.Event()
        self._tasks.start_soon(self._write, tensors, state)

    async def save_on_interrupt(self, outcome: Outcome | None) -> None:
        """The teardown save: after an interrupt, at the last completed window."""
        saved = max(self.last_saved, 0)
        if not (
            outcome is not None
            and outcome.reason == "interrupted"
            and self.config.loop.save_on_interrupt
            and self.clock.step > saved
        ):
            return
        if self.clock.step % self.config.loop.accumulate:
            self.clock.rewind(self.clock.window_start)
            if self.clock.step <= saved:
                return
        await self.save()

    async def _write(self, tensors: Any, state: checkpoint.TrainerState) -> None:
        try:
            with self.trace.span("write", "checkpoint", step=state.step):
                path = await self._bounded_write(tensors, state)
                if path is not None:
                    mode, keep = self.config.loop.compute, self.config.checkpoint.keep
                    await blocking_io(mode, checkpoint.prune, self.run_dir, keep)
            if path is not None:
                self.events.emit("checkpoint_written", state.step, path=str(path))
        except OSError as exc:  # disk full, I/O error: say what survives
            failed = await blocking_io(
                self.config.loop.compute, checkpoint.write_failed, self.run_dir, state.step, exc
            )
            self.error = self.error or failed
            self.control.stop("error")
        except Exception as exc:  # a failed save fails the run: stop it, surface the error
            self.error = self.error or exc
            self.control.stop("error")
        finally:
            self._pending -= 1
            if self._pending == 0:
                self._done.set()

    async def _bounded_write(self, tensors: Any, state: checkpoint.TrainerState) -> Path | None:
        """The write, off the loop (inline in inline mode), within its deadline; an
        overrun is a :class:`TimeoutError`, reported as an ``OSError`` like a full disk.
        A worker thread, as before, not a lane: a lane sets torch's thread count, and a
        writer has no business changing it. Abandoned at the deadline, the thread is not
        a daemon, so ``corun`` ends the process with ``os._exit`` rather than wait."""
        write = partial(checkpoint.write, self.run_dir, state.step, tensors, state,
                        writes=self.writes)  # fmt: skip
        if self.config.loop.compute == "inline":
            return write()
        timeout_s = self.config.checkpoint.write_timeout_s
        with anyio.move_on_after(timeout_s):
            return await anyio.to_thread.run_sync(write, abandon_on_cancel=True)
        why = f"did not finish within {timeout_s:g} s: checkpoint.write_timeout_s"
        raise TimeoutError(errno.ETIMEDOUT, why)

    async def drain(self) -> None:
        """Wait for every pending write (a teardown step)."""
        if self._pending:
            await self._done.wait()


def _snapshot(state: Callable[[], Any], kept: list[dict[str, Any]] | None) -> Any:
    tensors = checkpoint.snapshot(state())
    if kept is not None:
        tensors["rollouts"] = checkpoint.snapshot(kept)
    return tensors
