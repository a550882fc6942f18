"""Data-parallel overhead: steps/s at world size 1 vs 2 (``corun train`` with
``run.nproc``, torchrun under it, gloo) on the same global batch, and the time per
step spent in collectives (the gradient, token-count and metrics all-reduces).

::

    python -m benchmarks.distributed            # 40 steps per run
    python -m benchmarks.distributed --quick    # 6 steps per run, a smoke test

Each run is a real ``corun train`` subprocess; steps/s is measured between the first
and the last ``step`` event (process start, torch import and rendezvous left out).
Every run gets one torch thread per process (``OMP_NUM_THREADS=1``, what torchrun
sets), so world size 2 uses both cores where world size 1 uses one. Nothing is
asserted: the figures are ratios within one run of this script, on a machine that
other jobs share.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import tomli_w

from corun.records.events import EVENTS_FILE, METRICS_FILE, read_records

SMALL = {"task": "sort", "d_model": 64, "n_heads": 2, "n_layers": 2, "eval_size": 16}
KINDS = {
    "sft": ({"kind": "sft", **SMALL}, 32),
    "grpo": ({"kind": "grpo", **SMALL, "samples_per_prompt": 4, "truncated_reward": "keep"}, 8),
}


def run_once(kind: str, nproc: int, steps: int, root: Path) -> dict[str, Any]:
    trainer, batch_size = KINDS[kind]
    run_dir = root / f"{kind}-{nproc}"
    cfg = root / f"{kind}-{nproc}.toml"
    cfg.write_text(
        tomli_w.dumps({
            "trainer": trainer,
            "run": {"dir": str(run_dir), "steps": steps, "nproc": nproc},
            "loop": {"baseline_eval": False},
            "data": {"batch_size": batch_size},
            "log": {"progress": "off"},
        })
    )  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    done = subprocess.run(
        [sys.executable, "-m", "corun", "train", str(cfg)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    if done.returncode:
        raise SystemExit(f"{kind} at {nproc} ranks failed:\n{done.stderr[-2000:]}")
    times = [e["t"] for e in read_records(run_dir / EVENTS_FILE) if e["event"] == "step"]
    records = [r for r in read_records(run_dir / METRICS_FILE) if "train/loss" in r]
    collective = [r.get("perf/collective_time_s", 0.0) for r in records]
    return {
        "kind": kind,
        "nproc": nproc,
        "steps_per_s": (len(times) - 1) / (times[-1] - times[0]),
        "train_ms": 1e3 * statistics.mean(r["perf/train_time_s"] for r in records),
        "collective_ms": 1e3 * statistics.mean(collective),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 steps per run")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    steps = 6 if args.quick else 40
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            for nproc in (1, 2):
                rows.append(run_once(kind, nproc, steps, Path(tmp)))
    print(f"data-parallel overhead, {steps} steps per run, same global batch at 1 and 2 ranks")
    print(
        f"{'trainer':8} {'ranks':>5} {'steps/s':>8} {'vs 1 rank':>9} {'train ms/step':>13} "
        f"{'collective ms/step':>18} {'of train':>8}"
    )
    for row in rows:
        base = next(r for r in rows if r["kind"] == row["kind"] and r["nproc"] == 1)
        share = row["collective_ms"] / row["train_ms"]
        print(
            f"{row['kind']:8} {row['nproc']:>5} {row['steps_per_s']:>8.2f} "
            f"{row['steps_per_s'] / base['steps_per_s']:>8.2f}x {row['train_ms']:>13.1f} "
            f"{row['collective_ms']:>18.2f} {share:>7.1%}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
