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

The optional parts (remote rollout workers, the policy endpoint, prerequisite runs)
come in as :class:`Extensions`, built outside the loop: ``corun.run``
(corun/host/runs.py) assembles them from the config; this bare template runs without.
"""

from __future__ import annotations

import inspect
import secrets
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from corun.base.config import Config
from corun.base.errors import first_error
from corun.base.rng import seed_everything
from corun.contract.trainer import Batch, Outcome, ServingFn, SetupContext, Trainer, overrides
from corun.execution import device, distributed, guest
from corun.execution.compute import abandoning, blocking_io, call_hook
from corun.loop.cadence import Cadence
from corun.loop.checkpointer import Checkpointer
from corun.loop.clock import Clock, IdleTimes
from corun.loop.colocation import Colocation
from corun.loop.evaluation import Evaluator
from corun.loop.extensions import Extensions, RemoteRollouts, Service
from corun.loop.fused import FusedUpdate, Ran
from corun.loop.lanes import Lanes
from corun.loop.phases import Phases, stopwatch
from corun.loop.producer import Producer
from corun.loop.schedule import moved_horizon
from corun.loop.session import Session
from corun.loop.sync import WeightSync
from corun.loop.teardown import RunControl, Teardown, record_end
from corun.loop.update import Updater
from corun.records import checkpoint, rundir
from corun.records.events import EventLog, Trace
from corun.records.reporting import Reporter

if TYPE_CHECKING:
    import torch

BARE = Extensions()  # no optional parts


async def run(
    trainer: Trainer[Any], config: Config, *, control: RunControl | None = None,
    session: Session | None = None, extensions: Extensions = BARE,
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
        run_device = device.use(config.run.device)  # refused before the run directory
        checkpoint.check_writable(config.run_dir)
        with guest.running():
            async with rundir.put_back_on_refusal(config.run_dir, config.loop.compute) as guard:
                restored = await blocking_io(config.loop.compute, checkpoint.restore_point, config)
                config.run_dir.mkdir(parents=True, exist_ok=True)
                checkpoint.remove_partial_writes(config.run_dir)
                parts = _Run(trainer, config, session, restored, extensions, run_device)
                outcome = await guard.watch(parts).run()
        return outcome
    finally:
        session.over(outcome)


class _Run:
    """One run's components; ``run`` is the template, the rest are its named steps."""

    def __init__(
        self, trainer: Trainer[Any], config: Config, session: Session,
        restored: tuple[checkpoint.TrainerState, Any] | None, extensions: Extensions,
        run_device: torch.device,
    ) -> None:  # fmt: skip
        self.trainer, self.config, self.session = trainer, config, session
        self.device = run_device
        self.extensions = extensions
        self.control = control = session.control
        self.restored = restored
        state = restored[0] if restored else None
        self.run_id = state.run_id if state else secrets.token_hex(4)
        self.clock = clock = Clock.resume(config.loop, state)
        session.bind(clock)
        self.idle = IdleTimes()
        self.cadence = Cadence.of(config)
        self.events = events = EventLog(config.run_dir)
        self.trace = trace = Trace(config.run_dir)
        inline = config.loop.compute == "inline"
        self.teardown = Teardown(events, control, config.run.teardown_timeout_s, inline=inline)
        self.lanes = lanes = Lanes(config)
        self.reporter = Reporter(config, config.run_dir, clock.step if restored else 0)
        self.phases = phases = Phases(trace, events, self.reporter.log, clock)
        self.checkpointer = Checkpointer(config, self.run_id, clock, events, trace, control,
                                         lanes.train, trainer, resumed=bool(restored))  # fmt: skip
        self.weights = WeightSync(trainer, config, clock, lanes.train, phases)
        self.evaluator = Evaluator(trainer, config, lanes.train, phases)
        self.remote: RemoteRollouts | None = None
        self.updater: Updater | None = None  # for a trainer that supplies a loss
        self.plain_update = False  # the update is one plain call on the train lane
        self.colocation = Colocation((), self.cadence, phases)  # engines that sleep
        self.outcome: Outcome | None = None
        self.serving_hooks: list[ServingFn] = []  # the trainer's, run once it serves

    # ------------------------------------------------------------------ the template

    async def run(self) -> Outcome:
        failure: BaseException | None = None
        # Checkpoint writes and the endpoint: outside the root scope, so a stop never
        # cuts them short; teardown ends them.
        async with anyio.create_task_group() as background:
            self.checkpointer.attach(background)
            try:
                with anyio.CancelScope() as root:
                    self.control.bind(root)
                    await self._setup()
                    if self.restored is not None:
                        await self.weights.sync(forced=True)  # the engine booted with fresh weights
                    if self.extensions.service is not None:
                        await self._serve(background, self.extensions.service())
                    self.session.ready()
                    if self.session.serve_only:
                        await anyio.sleep_forever()  # `corun serve`: until stopped
                    await self.evaluator.baseline(resumed=self.restored is not None)
                    await self._train_steps()
            except BaseException as exc:  # a training error, or the host's cancellation
                failure = exc
            failure, outcome = self._settle(failure)
            teardown_error = await self.teardown.run(self.clock.step)
            if failure is None and self.checkpointer.error is not None:  # the last save's
                failure, outcome = self._settle(failure)
            if outcome.reason == "done" and self.teardown.cut_short:  # a stop cut it
                outcome = self.outcome = self.control.outcome(None, self.clock.step)
            self.lanes.close()
            self.trace.close()
            record_end(self.events, self.clock.step, outcome)
        if failure is not None:
            raise first_error(failure)
        if teardown_error is not None:
            raise teardown_error
        return outcome

    def _settle(self, failure: BaseException | None) -> tuple[BaseException | None, Outcome]:
        """The run's first error (a failed checkpoint write is one) and its outcome."""
        failure = failure or self.checkpointer.error
        self.outcome = self.control.outcome(failure, self.clock.step)
        return failure, self.outcome

    async def _setup(self) -> None:
        config, trainer, teardown = self.config, self.trainer, self.teardown
        teardown.push("on_train_end", self._on_train_end)
        self.events.emit(
            "start", self.clock.step, run_id=self.run_id, resumed=self.restored is not None,
            steps=config.run.steps, config_digest=config.digest(),
            lane_threads=self.lanes.train.threads,  # None: following the free cores
            **device.describe(self.device),
        )  # fmt: skip
        # Before this run's progress display starts: a prerequisite shows its own.
        await self.extensions.train_prerequisites(trainer, self.events, self.clock.step)
        self.reporter.start()
        teardown.push("logging", self.reporter.close)
        # Model init draws from the global RNGs; seeded on the lane: the first seeding
        # imports numpy.random and reads source files, ~10 ms the host's loop would wait.
        await self.lanes.train.run(seed_everything, config.run.seed)
        ctx = SetupContext(config, register=teardown.push, device=self.device)
        ctx.lane = self.lanes.train
        # Episodes arrive from outside only through a host that embeds the run, or the
        # endpoint's capture: otherwise a trainer that waits on the inbox would wait forever.
        if self.session.embedded or self.session.serve_only or config.serve.enabled:
            ctx.inbox = self.session.inbox
        with self.trace.span("setup", "trainer"), guest.setting_up(), _left_if_stopped():
            await call_hook(self.lanes.train, trainer.setup, ctx)
        self.events.emit("setup", self.clock.step)
        self.checkpointer.kept = ctx.kept
        self.serving_hooks = ctx.serving
        self.colocation.engines = ctx.sleepers
        self.updater = Updater.of(trainer, ctx.optimizers, config)
        self.plain_update = self._update_is_plain()
        self.dataset = distributed.sharded(trainer.dataset())  # the rank's slice of each batch
        if self.restored is not None:
            with _left_if_stopped():
                await self.checkpointer.restore(*self.restored, ctx.optimizers)
            if self.clock.step < config.run.steps:
                self._note(f"resuming {config.run_dir} from step {self.clock.step} of "
                           f"{config.run.steps}")  # fmt: skip
            moved = moved_horizon(config, self.restored[0].lr_horizon, self.clock.version)
            if moved is not None and self.clock.step < config.run.steps:
                self._note(moved)
        self.reporter.start_wandb(self.run_id, trainer.wandb_extra())
        if self.extensions.remote is not None:
            self.weights.remote = self.remote = await self.extensions.remote(
                len(self.lanes.rollout), self.clock, self.events, self.lanes.train
            )
            teardown.push("rollout_workers", self.remote.stop)
        teardown.push("checkpoints", self.checkpointer.drain)
        teardown.push("save", self._save_on_interrupt, optional=True)

    async def _serve(self, background: anyio.abc.TaskGroup, service: Service) -> None:
        """The policy endpoint, stopped in teardown before the trainer's own resources."""
        url = await background.start(service.run)
        self.teardown.push("endpoint", service.stop)
        self.session.endpoint_url = url
        self.events.emit("endpoint", self.clock.step, url=url)
        self._note(f"serving {url}")
        for hook in self.serving_hooks:
            await hook(url)

    def _note(self, text: str) -> None:
        self.reporter.progress.note(f"corun: {text}")

    async def _train_steps(self) -> None:
        """Batches from the producer → train steps, until the step budget is spent."""
        if self.clock.step >= self.config.run.steps:
            self._note(
                f"{self.config.run_dir} is complete ({self.clock.step} steps): nothing to do; "
                "raise run.steps to continue, or set run.dir to start a new run"
            )
            return
        producer = Producer(
            self.trainer, self.dataset, self.lanes.rollout, self.clock, self.idle, self.trace,
            self.events, distributed.rollout_config(self.config), stop=self.config.run.steps,
            remote=self.remote, kept=self.checkpointer.rollouts,
        )  # fmt: skip
        # An update fused into its rollout's lane call would run before a colocated
        # engine sleeps.
        fuses = self.plain_update and not self.colocation.engines
        fused = FusedUpdate(self._apply_update, self.clock) if fuses else None
        async with producer.batches(fused) as next_batch:
            while self.clock.step < self.config.run.steps:
                try:
                    with stopwatch() as waited:
                        batch = await next_batch()
                except anyio.EndOfStream:  # the workers failed: their error surfaces here
                    break
                ran = fused.take(batch) if fused is not None else None
                # The wait ended where the batch was handed over: to this task, or to its
                # update in the rollout's own lane call.
                self.idle.trainer_s += (
                    waited.seconds if ran is None else ran.handed.monotonic - waited.started
                )
                if self.clock.is_stale(batch.version):
                    producer.drop(batch)  # its data index is generated again
                else:
                    await self._train_one(batch, ran)

    # ------------------------------------------------------------------ one step

    async def _train_one(self, batch: Batch, ran: Ran | None) -> None:
        """Train on ``batch``: its update, or the one already ``ran`` in its rollout's
        lane call; then sync, eval and save when the cadence says."""
        staleness = self.clock.version - batch.version
        since = ran.handed if ran is not None else None
        step = self.clock.step + 1
        await self.colocation.sleep(step)
        with self.phases.phase("train", "train", "step", since, step=step) as trained:
            metrics = await self._update(batch, ran)
            # The update has been applied: record it before any further await, so a
            # cancellation from here on cannot lose the step's bookkeeping.
            self.clock.trained(batch.index)
            idle, lag = self.idle.take(), self.clock.async_metrics(staleness)
            memory = device.memory_metrics(self.device)
            trained.metrics = {**metrics, **batch.metrics, **idle, **lag, **memory}
            trained.fields = {"version": self.clock.version, "index": batch.index,
                              "rollout_version": batch.version}  # fmt: skip
            if batch.weights:
                trained.fields["weights"] = batch.weights
        step = self.clock.step  # then each of these when the cadence says
        await self.weights.after(step)
        await self.colocation.wake(step)
        await self.evaluator.after(step)
        await self.checkpointer.after(step)
        self.clock.completed()

    async def _update(self, batch: Batch, ran: Ran | None) -> dict[str, Any]:
        result: Any
        if ran is not None:
            result = ran.outcome()
        elif self.plain_update:
            result = await self.lanes.train.run(self._apply_update, batch)
        elif overrides(self.trainer, "train_step"):  # an async one: on the loop
            result = self.trainer.train_step(batch)
        else:
            return {}
        return dict(await result if inspect.isawaitable(result) else result)

    def _update_is_plain(self) -> bool:
        """Whether the step's update is one plain call on the train lane (the update
        protocol's, or a trainer's own synchronous ``train_step``)."""
        train_step = self.trainer.train_step
        return self.updater is not None or (
            overrides(self.trainer, "train_step") and not inspect.iscoroutinefunction(train_step)
        )

    def _apply_update(self, batch: Batch) -> Any:
        """The step's update, on the train lane's thread: a step's metrics (a trainer's
        ``train_step`` may return an awaitable of them)."""
        if self.updater is not None:
            window_pos = self.cadence.window_pos(self.clock.step)
            version = self.clock.version  # the window's start: no update applied yet
            return self.updater.train(batch, window_pos, version)
        return self.trainer.train_step(batch)

    # ------------------------------------------------------------------ teardown steps

    async def _save_on_interrupt(self) -> None:
        await self.checkpointer.save_on_interrupt(self.outcome)

    async def _on_train_end(self) -> None:
        assert self.outcome is not None
        if overrides(self.trainer, "on_train_end"):
            await call_hook(self.lanes.train, self.trainer.on_train_end, self.outcome)


# A stop during set-up (loading a model, building an engine: single blocking calls of
# seconds, with no cancel points) does not wait for it in the `corun` command: the call
# is left to its thread after this grace, and the process exits once torn down. Nothing
# is saved before set-up ends, so nothing half-done is saved. In a host's process the
# call is awaited: a thread left building an engine would outlive the run.
SETUP_STOP_GRACE_S = 0.1


def _left_if_stopped() -> AbstractContextManager[None]:
    return abandoning(SETUP_STOP_GRACE_S) if guest.process_ends_with_runs() else nullcontext()
