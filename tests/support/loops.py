"""What the trainer test files share: the one hand-written loop every parity test
compares a template run with, per-step records without timings, and a hook-recording
mixin for golden orders."""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Generic, TypeVar

import anyio
import torch

import corun
from corun.loop.update import Updater
from corun.records.events import read_records

T = TypeVar("T", bound=corun.Trainer[Any])


def handwritten_loop(trainer_cls: type[T], config: corun.Config) -> tuple[T, list[dict[str, Any]]]:
    """What a person writes without corun, following the documented update protocol.

    Seed, build; then for each data index: rollout (drawing from its generator of
    (seed, index, 0)) → prepare → backpropagate mini-batch 0, micro-batch by
    micro-batch, scaled by 1/window → at the window's end: clip and step every
    optimizer, then the window's other mini-batches (one step each) → publish every
    ``sync_interval`` steps. Records each step's metrics as the runtime defines them.
    """
    corun.seed_everything(config.run.seed)
    trainer = trainer_cls(config)
    ctx = corun.SetupContext(config)
    call(trainer.setup, ctx)
    data, loop, seed = trainer.dataset(), config.loop, config.run.seed
    window: list[tuple[corun.Batch, torch.Generator]] = []
    records = []
    for index in range(config.run.steps):
        rollout_ctx = corun.RolloutContext(index, corun.rollout_generator(seed, index, 0))
        batch = call_rollout(trainer, data.batch(index), rollout_ctx)
        batch.index = index
        if index % loop.accumulate == 0:
            _zero_grad(ctx)
            window = []
        batch.data = trainer.prepare(batch)
        window.append((batch, corun.update_generator(seed, index)))
        sums: dict[str, list[float]] = defaultdict(list)
        version = index // loop.accumulate  # the window's start: updates applied so far
        _backward(trainer, *window[-1], 0, loop, sums, version)
        if (index + 1) % loop.accumulate == 0:
            _step(ctx, sums)
            for mini in range(1, loop.mini_batches):
                _zero_grad(ctx)
                for pending in window:
                    _backward(trainer, *pending, mini, loop, sums, version)
                _step(ctx, sums)
        metrics = {f"train/{key}": sum(values) / len(values) for key, values in sums.items()}
        records.append({"step": index + 1, **metrics, **batch.metrics})
        if (index + 1) % loop.sync_every == 0:
            call(trainer.sync_weights, (index + 1) // loop.accumulate)
    return trainer, records


def call(hook: Any, *args: Any) -> Any:
    """A hook as a plain call; an ``async def`` one (an engine behind it) runs in an
    event loop of its own (call this outside one)."""
    if inspect.iscoroutinefunction(hook):
        return anyio.run(hook, *args)
    return hook(*args)


def call_rollout(
    trainer: corun.Trainer[Any], inputs: Any, ctx: corun.RolloutContext
) -> corun.Batch:
    """``trainer.rollout`` as a plain call (see :func:`call`)."""
    result = call(trainer.rollout, inputs, ctx)
    return result if isinstance(result, corun.Batch) else corun.Batch(result)


def _backward(
    trainer: corun.Trainer[Any], batch: corun.Batch, generator: torch.Generator, mini: int,
    loop: Any, sums: dict[str, list[float]], version: int,
) -> None:  # fmt: skip
    micros = trainer.micro_batches(batch)
    total = 0.0
    for micro in range(micros):
        part = corun.Part(mini, loop.mini_batches, micro, micros, generator, version)
        loss, metrics = trainer.loss(batch, part)
        (loss if loop.accumulate == 1 else loss / loop.accumulate).backward()
        total += float(loss.detach())
        for key, value in metrics.items():
            sums[key].append(float(value))
    sums["loss"].append(total)


def _zero_grad(ctx: corun.SetupContext) -> None:
    for spec in ctx.optimizers:
        spec.optimizer.zero_grad(set_to_none=True)


def _step(ctx: corun.SetupContext, sums: dict[str, list[float]]) -> None:
    for spec in ctx.optimizers:
        clip = spec.grad_clip if spec.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(spec.params, clip))
        sums["grad_norm" if spec.name == "model" else f"{spec.name}/grad_norm"].append(norm)
        spec.optimizer.step()


class Harness(Generic[T]):
    """A trainer set up by hand, as the runtime would (seeded, optimizers registered),
    for unit tests of its parts: rollouts with their generators, single updates."""

    def __init__(self, trainer_cls: type[T], config: corun.Config, seed: int | None = None) -> None:
        corun.seed_everything(config.run.seed if seed is None else seed)
        self.config = config
        self.trainer = trainer_cls(config)
        self.ctx = corun.SetupContext(config)
        call(self.trainer.setup, self.ctx)
        self.data = self.trainer.dataset()
        self.updates = 0
        self.updater = Updater(
            self.trainer, self.ctx.optimizers, window=1, mini_batches=1, seed=config.run.seed
        )

    def rollout(self, index: int, inputs: Any = None) -> corun.Batch:
        """The rollout of data ``index`` (or of ``inputs``), as the producer makes it."""
        generator = corun.rollout_generator(self.config.run.seed, index, 0)
        inputs = self.data.batch(index) if inputs is None else inputs
        batch = call_rollout(self.trainer, inputs, corun.RolloutContext(index, generator))
        batch.index = index
        return batch

    def update(self, batch: corun.Batch) -> dict[str, float]:
        """One update on ``batch`` (a window of one, one mini-batch)."""
        self.updates += 1
        return self.updater.train(batch, 0, self.updates - 1)

    def train(self, indexes: Iterable[int]) -> list[dict[str, float]]:
        return [self.update(self.rollout(index)) for index in indexes]


def without_timings(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if not k.startswith("perf/")}


def step_records(run_dir: Path, key: str = "train/loss") -> list[dict[str, Any]]:
    """The run's per-step records (those with ``key``), timings left out."""
    return [without_timings(r) for r in read_records(run_dir / "metrics.jsonl") if key in r]


def lifecycle(run_dir: Path) -> list[str]:
    """Event names, without the background write completions (their timing varies)."""
    records = read_records(run_dir / "events.jsonl")
    return [r["event"] for r in records if r["event"] != "checkpoint_written"]


def is_png(path: Path) -> bool:
    return path.read_bytes().startswith(b"\x89PNG")


class RecordsHooks:
    """Mixed in before a trainer class: ``calls`` lists each hook the runtime called."""

    calls: list[str]

    def setup(self, ctx: corun.SetupContext) -> None:
        self.calls = ["setup"]
        super().setup(ctx)  # type: ignore[misc]

    def rollout(self, inputs: Any, ctx: corun.RolloutContext) -> corun.Batch:
        self.calls.append(f"rollout:{ctx.index}")
        return super().rollout(inputs, ctx)  # type: ignore[misc, no-any-return]

    def prepare(self, batch: corun.Batch) -> Any:
        self.calls.append(f"train:{batch.index}")
        return super().prepare(batch)  # type: ignore[misc]

    def sync_weights(self, version: int) -> None:
        self.calls.append(f"sync:{version}")
        super().sync_weights(version)  # type: ignore[misc]

    def evaluate(self, step: int | None = None) -> dict[str, Any]:
        self.calls.append(f"eval:{step}")
        return super().evaluate(step)  # type: ignore[misc, no-any-return]

    def state_dict(self) -> dict[str, Any]:
        self.calls.append("state_dict")
        return super().state_dict()  # type: ignore[misc, no-any-return]

    def on_train_end(self, outcome: corun.Outcome) -> None:
        self.calls.append(f"on_train_end:{outcome.reason}")
        super().on_train_end(outcome)  # type: ignore[misc]
