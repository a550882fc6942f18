"""The real small model, sync vs async: ``configs/grpo.toml`` against
``configs/grpo_async.toml`` (same task, model, batch and seed), each a fresh
``corun train`` process. Printed: wall time per step (median), training wall time
(after the warm start and the baseline eval), and the wall time each took to first
reach the same held-out eval reward (the lower of the two runs' best)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from itertools import pairwise
from pathlib import Path
from typing import Any

from corun.records.events import EVENTS_FILE, read_records

CONFIGS = ("configs/grpo.toml", "configs/grpo_async.toml")


def train(
    config: str, run_dir: Path, steps: int, eval_interval: int, *overrides: str,
    metric: str = "eval/reward",
) -> dict[str, Any]:  # fmt: skip
    """``corun train`` in a fresh process; its median time per step, training time (from
    the end of the baseline eval), and the eval ``metric`` over (step, seconds)."""
    command = [
        sys.executable, "-m", "corun.host.cli", "train", config, f"run.dir={run_dir}",
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


def main(quick: bool = False) -> None:
    steps, eval_interval = (40, 20) if quick else (300, 25)
    print(f"\nreal GRPO ({os.cpu_count()} CPUs): {steps} steps, "
          f"eval every {eval_interval}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        results = {c: train(c, Path(tmp) / Path(c).stem, steps, eval_interval) for c in CONFIGS}
    target = min(max(r for _, _, r in res["curve"]) for res in results.values())
    print(f"{'config':>24} {'s/step':>7} {'train s':>8} {'final':>6} "
          f"{'to reward ' + format(target, '.3f'):>17}")  # fmt: skip
    for config, res in results.items():
        reached = next((t, s) for s, t, r in res["curve"] if r >= target)
        print(f"{config:>24} {res['step_s']:7.3f} {res['train_s']:8.1f} "
              f"{res['curve'][-1][2]:6.3f} {reached[0]:10.1f} s (step {reached[1]})")  # fmt: skip
    sync, async_ = (results[c] for c in CONFIGS)
    print(f"async/sync: time per step {async_['step_s'] / sync['step_s']:.2f}×, "
          f"training time {async_['train_s'] / sync['train_s']:.2f}×")  # fmt: skip
