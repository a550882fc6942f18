"""What the trainer test files share: the hand-written loop a template run must equal,
per-step records without timings, and a hook-recording mixin for golden orders."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import corun
from corun.events import read_jsonl

T = TypeVar("T", bound=corun.Trainer[Any])


def handwritten_loop(trainer_cls: type[T], config: corun.Config) -> tuple[T, list[dict[str, Any]]]:
    """What a person writes without corun: seed, build, then rollout → train (the update
    at each window's end) → sync, and the per-step records it would log."""
    corun.seed_everything(config.run.seed)
    trainer = trainer_cls(config)
    trainer.setup(corun.SetupContext(config))
    data, window = trainer.dataset(), config.loop.accumulate
    records = []
    for step in range(config.run.steps):
        batch = trainer.rollout(data.batch(step), step)
        batch.window_pos, batch.window_size = step % window, window
        metrics = trainer.train_step(batch)  # type: ignore[arg-type]
        records.append({"step": step + 1, **metrics, **batch.metrics})
        if (step + 1) % window == 0:
            trainer.sync_weights((step + 1) // window)
    return trainer, records


def without_timings(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if not k.startswith("perf/")}


def step_records(run_dir: Path, key: str = "train/loss") -> list[dict[str, Any]]:
    """The run's per-step records (those with ``key``), timings left out."""
    return [without_timings(r) for r in read_jsonl(run_dir / "metrics.jsonl") if key in r]


def lifecycle(run_dir: Path) -> list[str]:
    """Event names, without the background write completions (their timing varies)."""
    records = read_jsonl(run_dir / "events.jsonl")
    return [r["event"] for r in records if r["event"] != "checkpoint_written"]


def is_png(path: Path) -> bool:
    return path.read_bytes().startswith(b"\x89PNG")


class RecordsHooks:
    """Mixed in before a trainer class: ``calls`` lists each hook the runtime called."""

    calls: list[str]

    def setup(self, ctx: corun.SetupContext) -> None:
        self.calls = ["setup"]
        super().setup(ctx)  # type: ignore[misc]

    def rollout(self, inputs: Any, step: int) -> corun.Batch:
        self.calls.append(f"rollout:{step}")
        return super().rollout(inputs, step)  # type: ignore[misc, no-any-return]

    def train_step(self, batch: corun.Batch) -> dict[str, float]:
        self.calls.append(f"train:{batch.step}")
        return super().train_step(batch)  # type: ignore[misc, no-any-return]

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
