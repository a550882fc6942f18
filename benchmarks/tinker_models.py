"""``corun bench tinker_models``: many Tinker models on one base — step latency and
memory at 1, 4 and 16 models.

Each count is a fresh process (``python -m benchmarks.tinker_models_job ...``) that
loads the base once and makes that many rank-8 LoRA models on it, as ``corun serve
tinker`` does (trainers/hf/tinker.py's ``HFTrainingModel``: every model holds the
base's tensors themselves), then trains them round-robin: each model a
``forward_backward`` (cross-entropy, 8 sequences × 64 tokens) and an ``optim_step`` in
turn, so consecutive steps are of different models, as interleaved clients make them.
Figures: a model step's latency (p50, p90, after one warm-up round), the bytes of the
tensors all models hold (weights and optimizer state, a shared tensor counted once)
and the process's resident size after the last step, against one model's. The calls
are the backend's, in process: the HTTP protocol adds its fixed ~10 ms per call on top
(``corun bench tinker``). Bases: the built-in tiny Llama, and a randomly initialised
~50M-parameter Llama (``--quick``: ~6M).

::

    python -m benchmarks.tinker_models           # 1/4/16 models, both bases
    python -m benchmarks.tinker_models --quick
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.peers import BIG, ENV, SMALLER, Shape, big_model
from benchmarks.report import Note, Table, fmt
from benchmarks.suite import main_of

COUNTS = (1, 4, 16)
RANK, ROWS, TOKENS = 8, 8, 64


@dataclass(frozen=True)
class Grid:
    rounds: int  # timed rounds over every model, after one warm-up round
    big: Shape | None  # None: the tiny base only
    counts: tuple[int, ...] = COUNTS


GRIDS = {
    "full": Grid(5, BIG),
    "quick": Grid(3, SMALLER),
    "tiny": Grid(1, None, (1, 2)),
}


def run_job(model: str, count: int, rounds: int) -> dict[str, Any]:
    """benchmarks/tinker_models_job.py in a fresh process (its resident size its own)."""
    command = [sys.executable, "-m", "benchmarks.tinker_models_job", model, str(count),
               str(rounds)]  # fmt: skip
    done = subprocess.run(command, env=ENV, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{command[3:]} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def suite(grid_name: str, scratch: Path, note: Note) -> list[Table]:
    grid = GRIDS[grid_name]
    bases = [("tiny Llama", "tiny-llama")]
    if grid.big is not None:
        path, millions = big_model(scratch, grid.big)
        bases.append((f"~{millions:g}M Llama", f"hf:{path}"))
    rows: list[list[str]] = []
    ratios: list[tuple[str, float]] = []
    for label, model in bases:
        one: dict[str, Any] = {}
        for count in grid.counts:
            note(f"{label}: {count} model(s), {grid.rounds} round(s)")
            got = run_job(model, count, grid.rounds)
            one = one or got
            steps = got["step_ms"]
            rows.append([label, str(count), fmt(statistics.median(steps), 1),
                         fmt(percentile(steps, 0.9), 1), fmt(got["tensor_mib"], 1),
                         fmt(got["rss_mib"], 0)])  # fmt: skip
            ratios.append((f"{label}, {count}", got["rss_mib"] / one["rss_mib"]))
    columns = ["base", "models", "step p50 ms", "step p90 ms", "tensors MiB", "resident MiB"]
    notes = [f"A step: forward_backward (cross-entropy, {ROWS} x {TOKENS} tokens) and "
             f"optim_step of one rank-{RANK} model, models in turn."]  # fmt: skip
    return [Table("tinker_models", "memory", "Tinker models on one base", columns, rows,
                  ratios, "one model's resident size", notes)]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main_of("tinker_models", __doc__.splitlines()[0]))
