"""Async throughput: sync vs async, with latency-only fakes against the ideal bound,
free-running vs fixed version schedule, and on the real small model (the grpo recipe
vs grpo_async): the ``async`` suite of ``corun bench``, and a program of its own::

    python -m benchmarks.async_throughput            # the fake grids, a few minutes
    python -m benchmarks.async_throughput --quick    # a smoke run of the grids
    python -m benchmarks.async_throughput --real     # + the real GRPO comparison
    python -m benchmarks.async_throughput --real-only

A fake trainer whose ``rollout`` and ``train_step`` only sleep (``async def``, so no
compute and no threads) runs through the real template. With generation taking
``g`` and a train step ``t`` seconds, ``w`` rollout workers can at best deliver one
batch every ``g / w``; the trainer needs ``t`` per batch; so no schedule beats
``1 / max(g / w, t)`` steps per second. Synchronous (concurrency 1) runs at
``1 / (g + t)``. Each row prints steps per second and its fraction of the bound,
and of the bound computed from the latencies the sleeps really took (a sleep
overshoots by up to ~1 ms on a busy VM; that part is not the template's).
The second table draws each generation time from ±50 % of ``g`` and compares
start-order with completion-order consumption. The third compares the version
schedules under that jitter: free-running (completion order, the throughput
default) against fixed (start order, which it needs), with the mean staleness each
trains at. Nothing is asserted: timings belong in benchmarks.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import zlib
from itertools import pairwise
from pathlib import Path
from typing import Any

import anyio

from benchmarks import time_to_reward
from benchmarks.report import Note, Table, fmt
from corun.base.config import TrainerConfig
from corun.contract.config_file import config_from_dict
from corun.contract.trainer import Batch, RolloutContext, Trainer
from corun.loop.template import run
from corun.records.events import EVENTS_FILE, read_records


class SleepConfig(TrainerConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    generate_s: float = 0.02
    train_s: float = 0.01
    jitter: float = 0.0  # each generation takes generate_s × (1 ± jitter), fixed per index


class SleepTrainer(Trainer[SleepConfig]):
    """Latency only: what is measured is the template's scheduling."""

    Config = SleepConfig

    async def rollout(self, inputs: Any, ctx: RolloutContext) -> Batch:
        spread = (zlib.crc32(str(ctx.index).encode()) % 1000) / 500 - 1.0  # in [-1, 1)
        await anyio.sleep(self.config.generate_s * (1 + self.config.jitter * spread))
        return Batch(inputs)

    async def train_step(self, batch: Batch) -> dict[str, float]:
        await anyio.sleep(self.config.train_s)
        return {}

    async def sync_weights(self, version: int) -> None:
        pass


KIND = f"{SleepTrainer.__module__}:{SleepTrainer.__qualname__}"


def measure(
    generate_s: float, train_s: float, workers: int, order: str, steps: int, backend: str,
    jitter: float = 0.0,
) -> tuple[float, float, float]:  # fmt: skip
    """Steady-state steps/s, the bound from the latencies the sleeps really took, and
    the mean staleness. ``order`` is "sync", "start", "completion" or "fixed" (start
    order under the fixed version schedule)."""
    concurrency = 1 if order == "sync" else max(2, workers + 1)
    schedule = "fixed" if order == "fixed" else "free"
    with tempfile.TemporaryDirectory() as run_dir:
        config = config_from_dict({
            "run": {"dir": run_dir, "steps": steps},
            "loop": {"concurrency": concurrency, "workers": workers, "baseline_eval": False,
                     "compute": "inline", "max_staleness": concurrency + 1,
                     "order": "completion" if order == "completion" else "start",
                     "version_schedule": schedule},
            "log": {"progress": "off"},
            "trainer": {"kind": KIND, "generate_s": generate_s, "train_s": train_s,
                        "jitter": jitter},
        })  # fmt: skip
        anyio.run(run, SleepTrainer(config), config, backend=backend)
        times = [r["t"] for r in read_records(Path(run_dir) / EVENTS_FILE) if r["event"] == "step"]
        records = [r for r in read_records(Path(run_dir) / "metrics.jsonl") if "step" in r]
    # Steady state: skip the first few steps, while the first rollouts queue up.
    rate = 1.0 / statistics.fmean(b - a for a, b in pairwise(times[concurrency:]))
    g = statistics.fmean(r["perf/rollout_time_s"] for r in records if "perf/rollout_time_s" in r)
    t = statistics.fmean(r["perf/train_time_s"] for r in records if "perf/train_time_s" in r)
    staleness = [r.get("async/staleness_mean", 0.0) for r in records if "perf/train_time_s" in r]
    bound = 1.0 / (g + t if order == "sync" else max(g / workers, t))
    return rate, bound, statistics.fmean(staleness)


GRIDS = {  # train step s, steps, gen/train ratios, worker counts
    "full": (0.05, 40, (0.5, 1.0, 2.0, 4.0), (1, 2, 4)),
    "quick": (0.02, 12, (1.0, 2.0), (1, 2)),
    "tiny": (0.01, 8, (2.0,), (2,)),
}


def suite(grid: str, scratch: Path, note: Note) -> list[Table]:
    """``corun bench async``: sync vs async steps/s with latency-only fakes, as a fraction
    of the ideal bound ``1 / max(gen / workers, train)`` (sync: ``1 / (gen + train)``)."""
    train_s, steps, ratios, worker_counts = GRIDS[grid]
    rows, labels = [], []
    for ratio in ratios:
        generate_s = ratio * train_s
        sync_rate = 0.0
        for order, workers in [("sync", 1), *(("start", w) for w in worker_counts)]:
            note(f"gen/train {ratio:g}, {order}, {workers} worker(s)")
            rate, measured, staleness = measure(
                generate_s, train_s, workers, order, steps, "asyncio"
            )
            bound = 1 / (generate_s + train_s if order == "sync" else max(generate_s / workers,
                                                                          train_s))  # fmt: skip
            sync_rate = sync_rate or rate
            mode = "sync" if order == "sync" else f"async, {workers} worker(s)"
            rows.append([f"{ratio:g}", mode, fmt(rate, 1), fmt(bound, 1), f"{rate / bound:.1%}",
                         f"{rate / measured:.1%}", f"{rate / sync_rate:.2f}",
                         f"{staleness:.2f}"])  # fmt: skip
            labels.append((f"g/t {ratio:g} {mode}", rate / bound))
    return [Table(
        "async", "bound", f"Steps/s against the ideal bound (latency-only fakes, train step "
        f"{train_s * 1e3:g} ms, {steps} steps, asyncio)",
        ["gen / train", "mode", "steps/s", "bound", "of bound", "of measured bound", "vs sync",
         "staleness"], rows, labels,
        "the ideal bound 1 / max(gen / workers, train) (sync: 1 / (gen + train))",
    )]  # fmt: skip


def print_grid(rows: list[tuple[float, str, int]], train_s: float, steps: int, backend: str,
               jitter: float = 0.0) -> None:  # fmt: skip
    print(f"{'gen/train':>9} {'mode':>10} {'workers':>7} {'steps/s':>8} {'bound':>8} "
          f"{'staleness':>9} {'of bound':>8} {'of measured':>11}")  # fmt: skip
    for ratio, order, workers in rows:
        generate_s = ratio * train_s
        rate, measured_bound, staleness = measure(
            generate_s, train_s, workers, order, steps, backend, jitter
        )
        if order == "sync":
            bound = 1.0 / (generate_s + train_s)
        else:
            bound = 1.0 / max(generate_s / workers, train_s)
        print(f"{ratio:9g} {order:>10} {workers:7d} {rate:8.1f} {bound:8.1f} {staleness:9.2f} "
              f"{rate / bound:8.1%} {rate / measured_bound:11.1%}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: a smaller grid")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--train-ms", type=float, default=50.0, help="the fake train step")
    parser.add_argument("--real", action="store_true", help="also grpo.toml vs grpo_async.toml")
    parser.add_argument("--real-only", action="store_true", help="only the real comparison")
    args = parser.parse_args()
    if args.real_only:
        time_to_reward.print_grpo(quick=args.quick)
        return 0
    steps = 12 if args.quick else 40
    train_s = args.train_ms / 1e3
    ratios = (1.0, 2.0) if args.quick else (0.5, 1.0, 2.0, 4.0)
    worker_counts = (1, 2) if args.quick else (1, 2, 4)
    started = time.monotonic()
    print(f"corun async throughput ({args.backend}): latency-only fakes, train step "
          f"{args.train_ms:g} ms, {steps} steps, steady state")  # fmt: skip
    grid = [(r, "sync", 1) for r in ratios[:1]]
    for ratio in ratios:
        grid += [(ratio, "sync", 1)] * (ratio != ratios[0])
        grid += [(ratio, "start", w) for w in worker_counts]
    print_grid(grid, train_s, steps, args.backend)
    print("\ngeneration time ±50 % per batch: start vs completion order")
    jittered = [(r, order, w) for r in ratios[1:] for w in worker_counts[1:]
                for order in ("start", "completion")]  # fmt: skip
    print_grid(jittered, train_s, steps, args.backend, jitter=0.5)
    print("\ngeneration time ±50 % per batch: free-running (completion) vs fixed schedule")
    schedules = [(r, order, w) for r in ratios[1:] for w in worker_counts[1:]
                 for order in ("completion", "fixed")]  # fmt: skip
    print_grid(schedules, train_s, steps, args.backend, jitter=0.5)
    print(f"({time.monotonic() - started:.0f} s)")
    if args.real:
        time_to_reward.print_grpo(quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
