"""Sync vs async on real runs, each a fresh ``corun train`` process: the ``grpo`` recipe
against ``grpo_async`` (same task, model, batch and seed), and ``agentic`` against
``agentic_async`` (the same tools) at several ``env.latency_ms`` (each with the
recipes' long tail: one call in twenty takes ten times as long). The
``time_to_reward`` suite of ``corun bench``, and a program of its own::

    python -m benchmarks.time_to_reward --task grpo       # 300 steps each
    python -m benchmarks.time_to_reward --task agentic    # latencies 0, 25, 100 ms: ~5 min
    python -m benchmarks.time_to_reward --quick           # both, fewer steps

Printed: wall time per step (median), training wall time (after the warm start and
the baseline eval), and the wall time each run took to first reach the same held-out
eval figure (GRPO: the lower of the two runs' best reward; agentic: the sync run's
final success). Nothing is asserted: timings belong in benchmarks. Measure on a quiet
machine. A warm start is trained first, in ``runs/`` where this runs, and reused.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from itertools import pairwise
from pathlib import Path
from typing import Any

from benchmarks.report import Note, Table, fmt
from corun.records.events import EVENTS_FILE, read_records

GRPO = ("grpo", "grpo_async")  # recipes: sync, async
AGENTIC = ("agentic", "agentic_async")
Curve = list[tuple[int, float, float]]  # (step, seconds from the baseline eval, value)
GRIDS = {  # GRPO (steps, eval interval), agentic (steps, eval interval, latencies)
    "full": ((300, 25), (60, 5, (0.0, 25.0, 100.0))),
    "quick": ((12, 6), (6, 3, ())),  # GRPO alone: the agentic pair would double it
    "tiny": ((4, 2), (4, 2, (100.0,))),
}


def train(
    recipe: str, run_dir: Path, steps: int, eval_interval: int, *overrides: str,
    metric: str = "eval/reward",
) -> dict[str, Any]:  # fmt: skip
    """``corun train`` in a fresh process; its median time per step, training time (from
    the end of the baseline eval), and the eval ``metric`` over (step, seconds)."""
    command = [
        sys.executable, "-m", "corun", "train", recipe, f"run.dir={run_dir}",
        f"run.steps={steps}", f"loop.eval_interval={eval_interval}", "log.progress=off",
        *overrides,
    ]  # fmt: skip
    subprocess.run(command, check=True, env={**os.environ, "WANDB_MODE": "disabled"})
    events = read_records(run_dir / EVENTS_FILE)
    start = next(e["t"] for e in events if e["event"] == "baseline_eval")
    step_times = [e["t"] for e in events if e["event"] == "step"]
    eval_times = {e["step"]: e["t"] for e in events if e["event"] in ("eval", "baseline_eval")}
    values = {r["step"]: r[metric] for r in read_records(run_dir / "metrics.jsonl") if metric in r}
    return {
        "step_s": statistics.median(b - a for a, b in pairwise(step_times)),
        "train_s": step_times[-1] - start,
        "curve": [(step, eval_times[step] - start, values[step]) for step in sorted(values)],
    }


def time_to(curve: Curve, target: float) -> tuple[float, int] | None:
    """Seconds and step at which ``curve`` first reaches ``target``."""
    return next(((t, step) for step, t, value in curve if value >= target), None)


def _reached(curve: Curve, target: float) -> float | None:
    """Seconds (from the end of the baseline eval) to the first eval after it at
    ``target`` or above."""
    return next((t for step, t, value in curve if step > 0 and value >= target), None)


def compare_grpo(steps: int, every: int, scratch: Path) -> dict[str, Any]:
    """Both GRPO runs, and the reward both reach: the lower of the two runs' best eval
    after the baseline (where both start)."""
    sync, async_ = (train(r, scratch / r, steps, every) for r in GRPO)
    target = min(max(r for step, _, r in res["curve"] if step > 0 or len(res["curve"]) == 1)
                 for res in (sync, async_))  # fmt: skip
    return {"target": target, "sync": sync, "async": async_}


def compare_agentic(latency_ms: float, steps: int, every: int, scratch: Path) -> dict[str, Any]:
    """Both agentic runs at one tool latency, and the sync run's final success."""
    latency = f"trainer.env.latency_ms={latency_ms}"
    sync, async_ = (train(r, scratch / f"{r}-{latency_ms:g}", steps, every, latency,
                          metric="eval/success") for r in AGENTIC)  # fmt: skip
    return {"latency_ms": latency_ms, "target": sync["curve"][-1][2], "sync": sync,
            "async": async_}  # fmt: skip


# ----------------------------------------------------------------------------- corun bench


def suite(grid: str, scratch: Path, note: Note) -> list[Table]:
    """``corun bench time_to_reward``: wall time per step and to the same held-out reward."""
    (steps, every), (a_steps, a_every, latencies) = GRIDS[grid]
    rows, ratios = [], []

    def add(task: str, result: dict[str, Any], steps: int) -> None:
        sync, async_, target = result["sync"], result["async"], result["target"]
        sync_at, async_at = _reached(sync["curve"], target), _reached(async_["curve"], target)
        ratio = async_at / sync_at if sync_at and async_at else None
        # Training time over the steps: a median interval misses async's bursts of steps.
        sync_step, async_step = sync["train_s"] / steps, async_["train_s"] / steps
        per_step = async_step / sync_step
        rows.append([task, f"{target:.3f}", fmt(sync_step, 3), fmt(async_step, 3),
                     f"{per_step:.2f}", "never" if sync_at is None else fmt(sync_at, 1),
                     "never" if async_at is None else fmt(async_at, 1),
                     "-" if ratio is None else f"{ratio:.2f}"])  # fmt: skip
        ratios.append((f"{task}: time per step", per_step))
        if ratio is not None:
            ratios.append((f"{task}: time to target", ratio))

    note(f"{' and '.join(GRPO)}: {steps} steps")
    add("GRPO (sort)", compare_grpo(steps, every, scratch), steps)
    for latency in latencies:
        note(f"agentic, tool latency {latency:g} ms: {a_steps} steps")
        add(f"agentic, tools {latency:g} ms", compare_agentic(latency, a_steps, a_every, scratch),
            a_steps)  # fmt: skip
    return [Table(
        "time_to_reward", "ratio", "Sync vs async: wall time to the same held-out reward",
        ["task", "target", "sync s/step", "async s/step", "async / sync per step",
         "sync s to target", "async s to target", "async / sync to target"], rows, ratios,
        "the sync run's time (per step, to the target), same run; below 1: async is faster",
        ["GRPO's target: the lower of the two runs' best eval reward after the baseline; "
         "agentic's: the sync run's final eval success. Times from the end of the baseline "
         "eval to the first later eval at the target; s/step: training time (from there) "
         "over the steps (\"never\": not within the run)."],
    )]  # fmt: skip


# ----------------------------------------------------------------------------- the program


def print_grpo(quick: bool = False) -> None:
    steps, eval_interval = (40, 20) if quick else (300, 25)
    print(f"\nreal GRPO ({os.cpu_count()} CPUs): {steps} steps, "
          f"eval every {eval_interval}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        result = compare_grpo(steps, eval_interval, Path(tmp))
    # The reward both reach, the baseline included (where both start).
    target = min(max(r for _, _, r in result[run]["curve"]) for run in ("sync", "async"))
    print(f"{'recipe':>24} {'s/step':>7} {'train s':>8} {'final':>6} "
          f"{'to reward ' + format(target, '.3f'):>17}")  # fmt: skip
    for recipe, run in zip(GRPO, ("sync", "async"), strict=True):
        res = result[run]
        reached = next((t, s) for s, t, r in res["curve"] if r >= target)
        print(f"{recipe:>24} {res['step_s']:7.3f} {res['train_s']:8.1f} "
              f"{res['curve'][-1][2]:6.3f} {reached[0]:10.1f} s (step {reached[1]})")  # fmt: skip
    sync, async_ = result["sync"], result["async"]
    print(f"async/sync: time per step {async_['step_s'] / sync['step_s']:.2f}×, "
          f"training time {async_['train_s'] / sync['train_s']:.2f}×")  # fmt: skip


def print_agentic(quick: bool = False) -> None:
    latencies = (0.0, 100.0) if quick else (0.0, 25.0, 100.0)
    steps, eval_interval = (20, 10) if quick else (60, 5)
    print(f"agentic sync vs async ({os.cpu_count()} CPUs): {steps} steps, eval every "
          f"{eval_interval}; time to the sync run's final held-out success")  # fmt: skip
    print(f"{'latency':>8} {'success':>8} {'sync s/step':>12} {'async s/step':>13} "
          f"{'sync to it':>11} {'async to it':>12} {'async/sync':>11}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for latency in latencies:
            row = compare_agentic(latency, steps, eval_interval, Path(tmp))
            sync_at = time_to(row["sync"]["curve"], row["target"])
            async_at = time_to(row["async"]["curve"], row["target"])
            assert sync_at is not None  # its own final value
            ratio = f"{async_at[0] / sync_at[0]:.2f}" if async_at else "never"
            async_text = f"{async_at[0]:.1f} s" if async_at else "never"
            print(f"{latency:6g} ms {row['target']:8.3f} {row['sync']['step_s']:12.3f} "
                  f"{row['async']['step_s']:13.3f} {sync_at[0]:9.1f} s {async_text:>12} "
                  f"{ratio:>11}", flush=True)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and latencies")
    parser.add_argument("--task", choices=("grpo", "agentic"), help="one (default: both)")
    args = parser.parse_args()
    if args.task in (None, "grpo"):
        print_grpo(args.quick)
    if args.task in (None, "agentic"):
        print_agentic(args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
