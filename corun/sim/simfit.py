"""``corun simulate --fit RUN_DIR``: the latency model of a real run, from its own records.

Read from ``metrics.jsonl``: each trained batch's ``perf/rollout_time_s`` and
``perf/train_time_s`` (the simulation draws from these measured times, so the model
keeps their spread and tail), and the mean ``perf/sync_time_s`` and
``perf/eval_time_s``. The first step's times are left out: they carry the warm-up
(first calls, allocator growth), which the steady state never sees again. A sync the
trainer does not implement logs no time: ``sync_s`` is then 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from corun.base.errors import ConfigError
from corun.records.events import METRICS_FILE, read_records


def fit(run_dir: str | Path) -> dict[str, Any]:
    """The ``[simulate]`` keys that reproduce ``run_dir``'s timings."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise ConfigError(f"--fit {run_dir}: no {METRICS_FILE} there (not a run directory)")
    metrics = read_records(path)
    steps = [m for m in metrics if "perf/train_time_s" in m]
    if len(steps) < 2:
        raise ConfigError(f"--fit {run_dir}: fewer than 2 trained steps to fit from")
    first = min(m["step"] for m in steps)
    steady = [m for m in steps if m["step"] > first]
    fitted: dict[str, Any] = {
        "rollout_times_s": [round(m["perf/rollout_time_s"], 6) for m in steady],
        "train_times_s": [round(m["perf/train_time_s"], 6) for m in steady],
    }
    for key, name in (("sync_s", "perf/sync_time_s"), ("eval_s", "perf/eval_time_s")):
        times = [m[name] for m in metrics if name in m and (m["step"] > first or key == "eval_s")]
        fitted[key] = round(float(np.mean(times)), 6) if times else 0.0
    return fitted
