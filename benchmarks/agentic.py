"""Agentic RL, sync vs async, over tool latencies: ``configs/agentic.toml`` against
``configs/agentic_async.toml`` (the same task, model, batch, seed and tools), each a
fresh ``corun train`` process, at several ``env.latency_ms`` (each with the configs'
long tail: one call in twenty takes ten times as long).

For each latency it prints the time per step, and the time each run took (from the
end of its baseline eval) to first reach the sync run's final held-out success; the
ratio async/sync is the figure the README quotes. Run from the repository root::

    python -m benchmarks.agentic            # latencies 0, 25, 100 ms: about 5 minutes
    python -m benchmarks.agentic --quick    # 0 and 100 ms, fewer steps

Nothing is asserted: timings belong in benchmarks. Measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.real_grpo import train

CONFIGS = ("configs/agentic.toml", "configs/agentic_async.toml")


def time_to(curve: list[tuple[int, float, float]], target: float) -> tuple[float, int] | None:
    """Seconds and step at which ``curve`` first reaches ``target``."""
    return next(((t, step) for step, t, value in curve if value >= target), None)


def compare(latency_ms: float, steps: int, eval_interval: int, tmp: Path) -> dict[str, Any]:
    latency = f"trainer.env.latency_ms={latency_ms}"
    runs = {}
    for config in CONFIGS:
        run_dir = tmp / f"{Path(config).stem}-{latency_ms:g}"
        runs[config] = train(config, run_dir, steps, eval_interval, latency, metric="eval/success")
    sync, async_ = (runs[c] for c in CONFIGS)
    target = sync["curve"][-1][2]
    return {"latency_ms": latency_ms, "target": target, "sync": sync, "async": async_,
            "sync_at": time_to(sync["curve"], target),
            "async_at": time_to(async_["curve"], target)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two latencies, fewer steps")
    args = parser.parse_args()
    latencies = (0.0, 100.0) if args.quick else (0.0, 25.0, 100.0)
    steps, eval_interval = (20, 10) if args.quick else (60, 5)
    print(f"agentic sync vs async ({os.cpu_count()} CPUs): {steps} steps, eval every "
          f"{eval_interval}; time to the sync run's final held-out success")  # fmt: skip
    print(f"{'latency':>8} {'success':>8} {'sync s/step':>12} {'async s/step':>13} "
          f"{'sync to it':>11} {'async to it':>12} {'async/sync':>11}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for latency in latencies:
            row = compare(latency, steps, eval_interval, Path(tmp))
            sync_at, async_at = row["sync_at"], row["async_at"]
            ratio = f"{async_at[0] / sync_at[0]:.2f}" if sync_at and async_at else "never"
            async_text = f"{async_at[0]:.1f} s" if async_at else "never"
            print(f"{latency:6g} ms {row['target']:8.3f} {row['sync']['step_s']:12.3f} "
                  f"{row['async']['step_s']:13.3f} {sync_at[0]:9.1f} s {async_text:>12} "
                  f"{ratio:>11}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
