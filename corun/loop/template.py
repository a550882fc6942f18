"""The loop template every trainer runs: ``await run(trainer, config)``.

The life of a run, top to bottom:

    read the resume checkpoint → prerequisite runs → start logging → seed → set up
    the trainer → restore (trainer state, data cursor; the first step then syncs) →
    baseline eval → per step: rollout (a producer task) → update → log → sync →
    eval → save, each when the cadence says → teardown (reverse set-up order) → end

Rollouts are produced by a task that feeds the trainer through a stream; admission
(``Clock.admit``) decides when the next rollout may start. With ``concurrency = 1``
a rollout starts only after the previous step is complete, so the calls happen in
exactly the order of a hand-written synchronous loop (generate → train → sync →
generate); more concurrency is the same code with a wider admission window. A batch
over the staleness bound when the trainer takes it (possible only in completion
order) is dropped and its data index generated again.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio

from corun.base import timebase
from corun.base.config import Config
from corun.base.errors import CheckpointError, ConfigError, first_error, is_cancellation
from corun.base.rng import seed_everything
from corun.contract.config_file import load_config
from corun.contract.registry import resolve_trainer
from corun.contract.trainer import Batch, Image, Outcome, SetupContext, Stateful, Trainer, overrides
from corun.execution import cores, distributed, guest
from corun.execution.compute import Lane, blocking_io, call_hook
from corun.host import prerequisites
from corun.loop import deadlines
from corun.loop.cadence import Cadence
from corun.loop.checkpointer import Checkpointer
from corun.loop.clock import Clock, IdleTimes
from corun.loop.producer import Producer
from corun.loop.session import Session
from corun.loop.teardown import RunControl, Teardown
from corun.loop.update import Updater
from corun.records import checkpoint, rundir
from corun.records.events import EventLog, Trace
from corun.records.reporting import Reporter
from corun.scale.ray_workers import RayWorkers
from corun.serve.server import Endpoint


async def run(
    trainer: Trainer[Any], config: Config, *, control: RunControl | None = None,
    session: Session | None = None,
) -> Outcome:  # fmt: skip
    """Train ``trainer`` to ``config.run.steps`` and tear down, on every path.

    Returns the outcome when the run finishes or is stopped through ``control`` (or
    the embedding ``session``'s); re-raises the first training error, or the host's
    cancellation, after teardown.
    """
    session = session or Session()
    if control is not None:
        session.control = control
    outcome: Outcome | None = None
    try:
        checkpoint.check_writable(config.run_dir)
        with guest.running():
            async with rundir.put_back_on_refusal(config.run_dir, config.loop.compute) as guard:
                restored = await blocking_io(config.loop.compute, checkpoint.restore_point, config)
                config.run_dir.mkdir(parents=True, exist_ok=True)
                checkpoint.remove_partial_writes(config.run_dir)
                outcome = await guard.watch(_Run(trainer, config, session, restored)).run()
        return outcome
    finally:
        session.over(outcome)


class _Run:
    """One run's components; ``run`` is the template, the rest are its named steps."""

    def __init__(
        self, trainer: Trainer[Any], config: Config, session: Session,
        restored: tuple[checkpoint.TrainerState, Any] | None,
    ) -> None:  # fmt: skip
        self.trainer = trainer
        self.config = config
        self.session = session
        self.control = control = session.control
        self.restored = restored
        self.run_dir: Path = config.run_dir
        state = restored[0] if restored else None
        self.run_id = state.run_id if state else secrets.token_hex(4)
        self.idle = IdleTimes()
        self.clock = Clock.start(
            config.loop,
            step=state.step if state else 0,
            version=state.version if state else 0,
            cursor=state.data_cursor if state else 0,
            trained_ahead=state.trained_ahead if state else [],
        )
        session.bind(self.clock)
        self.cadence = Cadence.of(config)
        self.events = EventLog(self.run_dir)
        self.trace = Trace(self.run_dir)
        loop = config.loop
        self.teardown = Teardown(
            self.events, control, config.run.teardown_timeout_s, inline=loop.compute == "inline"
        )
        # At concurrency 1 rollout and training share the thread, in order (exactly a
        # hand-written loop); above it, each rollout worker has a lane of its own.
        threads, share = loop.lane_threads, cores.side_by_side(config)
        self.train_lane = Lane("train", loop.compute, threads, share)
        lanes = [Lane(f"rollout-{i}", loop.compute, threads, share) for i in range(loop.workers)]
        self.rollout_lanes = [self.train_lane] if loop.concurrency == 1 else lanes
        self.reporter = Reporter(config, self.run_dir, self.clock.step if restored else 0)
        self.kept: dict[str, Stateful] = {}
        self.checkpointer = Checkpointer(
            config, self.run_id, self.clock, self.events, self.trace, control, self.train_lane,
            self._state, resumed=bool(restored),
        )  # fmt: skip
        self.updater: Updater | None = None  # for a trainer that supplies a loss
        self.outcome: Outcome | None = None

    # ------------------------------------------------------------------ the template

    async def run(self) -> Outcome:
        failure: BaseException | None = None
        # Checkpoint writes and the endpoint: outside the root scope, so a stop never
        # cuts them short; teardown ends them.
        async with anyio.create_task_group() as background:
            self.background = background
            self.checkpointer.attach(background)
            try:
                with anyio.CancelScope() as root:
                    self.control.bind(root)
                    await self._setup()
                    if self.restored is not None:
                        await self._sync(forced=True)  # the engine booted with fresh weights
                    if self.config.serve.enabled or self.session.serve_only:
                        await self._serve()
                    self.session.ready()
                    if self.session.serve_only:
                        await anyio.sleep_forever()  # `corun serve`: until stopped
                    await self._baseline_eval()
                    await self._train_steps()
            except BaseException as exc:  # a training error, or the host's cancellation
                failure = exc
            failure = failure or self.checkpointer.error
            self.outcome = self._outcome(failure)
            self.teardown.step = self.clock.step
            self.events.emit("teardown:stop", self.clock.step, status="ok")
            teardown_error = await self.teardown.run()
            if failure is None and self.checkpointer.error is not None:  # the last save's
                failure = self.checkpointer.error
                self.outcome = self._outcome(failure)
            for lane in {self.train_lane, *self.rollout_lanes}:
                lane.close()
            self.trace.close()
            self._end(self.outcome)
        if failure is not None:
            raise first_error(failure)
        if teardown_error is not None:
            raise teardown_error
        assert self.outcome is not None
        return self.outcome

    async def _setup(self) -> None:
        config, trainer, teardown = self.config, self.trainer, self.teardown
        teardown.push("on_train_end", self._on_train_end)
        self.events.emit(
            "start", self.clock.step, run_id=self.run_id, resumed=self.restored is not None,
            steps=config.run.steps, config_digest=config.digest(),
        )  # fmt: skip
        # Before this run's progress display starts: a prerequisite shows its own.
        for prerequisite in trainer.prerequisites():
            await self._prerequisite(Path(prerequisite))
        self.reporter.start()
        teardown.push("logging", self.reporter.close)
        # Model init draws from the global RNGs; seeded on the lane: the first seeding
        # imports numpy.random and reads source files, ~10 ms the host's loop would wait.
        await self.train_lane.run(seed_everything, config.run.seed)
        ctx = SetupContext(config, register=teardown.push)
        ctx.lane = self.train_lane
        ctx.inbox = self.session.inbox
        with self.trace.span("setup", "trainer"), guest.setting_up():
            await call_hook(self.train_lane, trainer.setup, ctx)
        self.events.emit("setup", self.clock.step)
        self.kept, self.optimizers = ctx.kept, ctx.optimizers
        self.updater = self._updater(ctx)
        self.dataset = distributed.sharded(trainer.dataset())  # the rank's slice of each batch
        if self.restored is not None:
            await self._restore(*self.restored)
        self.reporter.start_wandb(self.run_id, trainer.wandb_extra())
        self.remote = await RayWorkers.open(trainer, config, len(self.rollout_lanes), self.clock,
                                            self.events, self.train_lane, teardown)  # fmt: skip
        teardown.push("checkpoints", self.checkpointer.drain)
        teardown.push("save", self._save_on_interrupt, optional=True)

    async def _serve(self) -> None:
        """The policy endpoint, stopped in teardown before the trainer's own resources."""
        policy = self.trainer.served_policy()
        if policy is None:
            kind = self.config.trainer.kind
            raise ConfigError(f"`$.serve.enabled`: trainer {kind!r} serves no policy")
        loop, share = self.config.loop, cores.side_by_side(self.config)
        lane = Lane("serve", loop.compute, loop.lane_threads, share)
        endpoint = Endpoint(policy, self.config.serve, lane, self.session.inbox)
        url = await self.background.start(endpoint.run)
        self.teardown.push("endpoint", endpoint.stop)
        self.session.endpoint_url = url
        self.events.emit("endpoint", self.clock.step, url=url)
        self.reporter.progress.note(f"corun: serving {url}")

    def _updater(self, ctx: SetupContext) -> Updater | None:
        """The update protocol around the trainer's loss (unless it owns train_step)."""
        trainer = self.trainer
        if overrides(trainer, "train_step") or not overrides(trainer, "loss"):
            return None
        if not ctx.optimizers:
            raise TypeError(
                f"{type(trainer).__name__} defines a loss but registers no optimizer "
                "(ctx.add_optimizer in setup)"
            )
        loop = self.config.loop
        return Updater(
            trainer, ctx.optimizers, window=loop.accumulate, mini_batches=loop.mini_batches,
            seed=self.config.run.seed,
        )  # fmt: skip

    async def _prerequisite(self, path: Path) -> None:
        """Train a run this one starts from, unless it is complete already."""
        config = load_config(path)
        done = prerequisites.final_checkpoint(config)
        self.events.emit("prerequisite", self.clock.step, config=str(path), reused=bool(done))
        if done is None:
            trainer = resolve_trainer(config.trainer.kind)(config)
            await run(trainer, config)  # nested: a stop of this run cancels it too

    async def _restore(self, state: checkpoint.TrainerState, tensors: Any) -> None:
        try:
            await call_hook(self.train_lane, self.trainer.load_state_dict, tensors["trainer"])
            for name, component in self.kept.items():
                component.load_state_dict(tensors.get("kept", {})[name])
            checkpoint.check_optimizers(spec.optimizer for spec in self.optimizers)
        except Exception as exc:  # torch raises many types for tensors that do not fit
            where = checkpoint.resume_point(self.config)
            raise CheckpointError(f"{where}: does not fit this trainer: {exc}") from None
        if state.config_digest != self.config.digest():
            self.events.emit("config_changed", state.step, was=state.config_digest)
        self.events.emit("restore", state.step, version=state.version, cursor=state.data_cursor)
        self.checkpointer.rollouts.restore(tensors.get("rollouts"), state.step)
        if self.clock.step < self.config.run.steps:
            self.reporter.progress.note(
                f"corun: resuming {self.run_dir} from step {self.clock.step} of "
                f"{self.config.run.steps}"
            )

    async def _baseline_eval(self) -> None:
        if self.config.loop.baseline_eval and not self.restored:
            await self._evaluate("baseline_eval", self.trainer.evaluate_baseline)

    async def _train_steps(self) -> None:
        """Producer task → stream → train steps, until the step budget is spent."""
        if self.clock.step >= self.config.run.steps:
            self.reporter.progress.note(
                f"corun: {self.run_dir} is complete ({self.clock.step} steps): nothing to do; "
                "raise run.steps to continue, or set run.dir to start a new run"
            )
            return
        send, receive = anyio.create_memory_object_stream[Batch](self.config.loop.concurrency)
        async with anyio.create_task_group() as producers:
            producer = Producer(
                self.trainer, self.dataset, self.rollout_lanes, self.clock, self.idle,
                self.trace, distributed.rollout_config(self.config),
                stop=self.config.run.steps, remote=self.remote, kept=self.checkpointer.rollouts,
            )  # fmt: skip
            producers.start_soon(producer.run, send)
            async with receive:
                while self.clock.step < self.config.run.steps:
                    waiting = timebase.monotonic()
                    try:
                        batch = await receive.receive()
                    except anyio.EndOfStream:  # the producer failed: its error surfaces here
                        break
                    self.idle.trainer_s += timebase.monotonic() - waiting
                    if self.clock.is_stale(batch.version):
                        self._drop(batch)
                        producer.requeue(batch.index)
                    else:
                        await self._train_one(batch)
            producers.cancel_scope.cancel()

    def _drop(self, batch: Batch) -> None:
        """Overtaken in completion order: too stale to train on; its index is redone."""
        self.clock.drop()
        self.events.emit(
            "drop", self.clock.step, index=batch.index, staleness=self.clock.step - batch.version
        )

    # ------------------------------------------------------------------ one step

    async def _train_one(self, batch: Batch) -> None:
        started = timebase.monotonic()
        staleness = self.clock.version - batch.version
        metrics = await self._update(batch)
        # The update has been applied: record it before any further await, so a
        # cancellation from here on cannot lose the step's bookkeeping.
        self.clock.trained(batch.index)
        self.teardown.step = step = self.clock.step
        self._log_step(batch, metrics, staleness, timebase.monotonic() - started)
        if self.cadence.syncs(step):
            await self._sync()
        if self.cadence.evaluates(step):
            await self._evaluate("eval", self.trainer.evaluate_periodic, step)
        if self.cadence.saves(step):
            await self.checkpointer.save()
        self.clock.completed()

    async def _update(self, batch: Batch) -> dict[str, Any]:
        with self.trace.span("train", "trainer", step=self.clock.step + 1):
            if self.updater is not None:
                window_pos = self.cadence.window_pos(self.clock.step)
                return await self.train_lane.run(self.updater.train, batch, window_pos)
            if overrides(self.trainer, "train_step"):
                return dict(await call_hook(self.train_lane, self.trainer.train_step, batch))
            return {}

    def _log_step(
        self, batch: Batch, metrics: dict[str, Any], staleness: int, train_s: float
    ) -> None:
        metrics.update(batch.metrics)
        metrics["perf/train_time_s"] = train_s
        metrics.update(self.idle.take())
        if self.config.loop.concurrency > 1:
            # One batch per step: its staleness is the step's mean and max.
            metrics["async/staleness_mean"] = metrics["async/staleness_max"] = float(staleness)
            metrics["async/inflight"] = float(self.clock.inflight)
            metrics["async/dropped"] = float(self.clock.dropped)
        self._log(self.clock.step, metrics)
        self.events.emit("step", self.clock.step, version=self.clock.version, index=batch.index)

    async def _sync(self, forced: bool = False) -> None:
        version = self.clock.version
        if not overrides(self.trainer, "sync_weights"):
            self.clock.publish(version)
            return
        started = timebase.monotonic()
        with deadlines.sync(self.trace, self.config, version):  # run.sync_timeout_s
            await call_hook(self.train_lane, self.trainer.sync_weights, version)
            if self.remote is not None:
                await self.remote.publish(version)
        self.clock.publish(version)
        fields = {"forced": True} if forced else {}
        self.events.emit("sync", self.clock.step, version=version, **fields)
        self._log(self.clock.step, {"perf/sync_time_s": timebase.monotonic() - started})

    async def _evaluate(self, event: str, hook: Any, *args: Any) -> None:
        started = timebase.monotonic()
        with self.trace.span(event, "trainer"):
            metrics = dict(await call_hook(self.train_lane, hook, *args))
        metrics["perf/eval_time_s"] = timebase.monotonic() - started
        self._log(self.clock.step, metrics)
        self.events.emit(event, self.clock.step)

    def _log(self, step: int, metrics: Mapping[str, float | Image]) -> None:
        self.reporter.log(step, metrics)

    # ------------------------------------------------------------------ state and end

    def _state(self) -> dict[str, Any]:
        """What a checkpoint holds (live references; the checkpointer snapshots them)."""
        kept = {name: component.state_dict() for name, component in self.kept.items()}
        return {"trainer": self.trainer.state_dict(), "kept": kept}

    async def _save_on_interrupt(self) -> None:
        await self.checkpointer.save_on_interrupt(self.outcome)

    async def _on_train_end(self) -> None:
        assert self.outcome is not None
        if overrides(self.trainer, "on_train_end"):
            await call_hook(self.train_lane, self.trainer.on_train_end, self.outcome)

    def _outcome(self, failure: BaseException | None) -> Outcome:
        step = self.clock.step
        if failure is None and not self.control.stopped:
            return Outcome("done", step)
        if failure is not None and not is_cancellation(failure):
            return Outcome("error", step, error=first_error(failure))
        if self.control.stopped and self.control.reason != "error":
            return Outcome("interrupted", step, signal=self.control.signal)
        return Outcome("cancelled", step)

    def _end(self, outcome: Outcome) -> None:
        fields: dict[str, Any] = {"reason": outcome.reason}
        if outcome.signal:
            fields["signal"] = outcome.signal
        if outcome.error is not None:
            fields["error"] = f"{type(outcome.error).__name__}: {outcome.error}"
        self.events.emit("end", self.clock.step, **fields)
        self.events.close()
