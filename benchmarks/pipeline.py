"""Pipeline throughput with latency-only fakes: sync vs async against the ideal bound.

Run from the repository root::

    python -m benchmarks.pipeline            # the grid, about a minute
    python -m benchmarks.pipeline --quick    # a smoke run

A fake trainer whose ``rollout`` and ``train_step`` only sleep (``async def``, so no
compute and no threads) runs through the real template. With generation taking
``g`` and a train step ``t`` seconds, ``w`` rollout workers can at best deliver one
batch every ``g / w``; the trainer needs ``t`` per batch; so no schedule beats
``1 / max(g / w, t)`` steps per second. Synchronous (concurrency 1) runs at
``1 / (g + t)``. Each row prints steps per second and its fraction of the bound.
Nothing is asserted: timings belong in benchmarks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

os.environ["WANDB_MODE"] = "disabled"

import anyio

import corun
from corun.events import EVENTS_FILE, read_jsonl


class SleepConfig(corun.TrainerConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    generate_s: float = 0.02
    train_s: float = 0.01


class SleepTrainer(corun.Trainer[SleepConfig]):
    """Latency only: what is measured is the template's scheduling."""

    Config = SleepConfig

    async def rollout(self, inputs: Any, step: int) -> corun.Batch:
        await anyio.sleep(self.config.generate_s)
        return corun.Batch(inputs)

    async def train_step(self, batch: corun.Batch) -> dict[str, float]:
        await anyio.sleep(self.config.train_s)
        return {}

    async def sync_weights(self, version: int) -> None:
        pass


KIND = f"{SleepTrainer.__module__}:{SleepTrainer.__qualname__}"


def steps_per_second(generate_s: float, train_s: float, concurrency: int, workers: int,
                     steps: int, backend: str) -> float:  # fmt: skip
    with tempfile.TemporaryDirectory() as run_dir:
        config = corun.config_from_dict({
            "run": {"dir": run_dir, "steps": steps},
            "loop": {"concurrency": concurrency, "workers": workers, "baseline_eval": False,
                     "compute": "inline", "max_staleness": concurrency},
            "log": {"progress": "off"},
            "trainer": {"kind": KIND, "generate_s": generate_s, "train_s": train_s},
        })  # fmt: skip
        anyio.run(corun.run, SleepTrainer(config), config, backend=backend)
        times = [r["t"] for r in read_jsonl(Path(run_dir) / EVENTS_FILE) if r["event"] == "step"]
    # Steady state: skip the pipeline's fill (the first few steps).
    intervals = [b - a for a, b in pairwise(times[concurrency:])]
    return 1.0 / statistics.fmean(intervals)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: a smaller grid")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    args = parser.parse_args()
    steps = 20 if args.quick else 60
    train_s = 0.01
    ratios = (1.0, 2.0) if args.quick else (0.5, 1.0, 2.0, 4.0)
    worker_counts = (1, 2) if args.quick else (1, 2, 4)
    print(f"corun pipeline ({args.backend}): latency-only fakes, train step {train_s * 1e3:g} ms,"
          f" {steps} steps, steady state")  # fmt: skip
    print(
        f"{'gen/train':>9} {'mode':>6} {'workers':>7} {'steps/s':>8} {'bound':>8} {'of bound':>8}"
    )
    started = time.monotonic()
    for ratio in ratios:
        generate_s = ratio * train_s
        sync = steps_per_second(generate_s, train_s, 1, 1, steps, args.backend)
        sync_bound = 1.0 / (generate_s + train_s)
        print(
            f"{ratio:9g} {'sync':>6} {1:7d} {sync:8.1f} {sync_bound:8.1f} {sync / sync_bound:8.1%}"
        )
        for workers in worker_counts:
            concurrency = max(2, workers + 1)
            rate = steps_per_second(generate_s, train_s, concurrency, workers, steps, args.backend)
            bound = 1.0 / max(generate_s / workers, train_s)
            print(
                f"{ratio:9g} {'async':>6} {workers:7d} {rate:8.1f} {bound:8.1f} {rate / bound:8.1%}"
            )
    print(f"({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
