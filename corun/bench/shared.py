"""A short SFT run sharing the machine: the ``shared`` suite of ``corun bench``. The
same run (the ``sft`` recipe's model, in a fresh process) on the quiet machine, with
one busy process beside it, and with a plain torch loop beside it: corun's default
(torch threads from the free cores) against 2 fixed threads (torch's own default,
corun's before), inline compute and a plain torch SFT loop as the measured run (not in
the quick grid)."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

from corun.bench import overhead
from corun.bench.report import Note, Table, fmt

GRIDS = {"full": 80, "quick": 20, "tiny": 5}  # steps
COMPETITORS = {  # what runs beside the measurement: a command, killed after
    "quiet": None,
    "one busy process": "while True: pass",
    "a plain torch loop": "import torch\nx = torch.randn(256, 256)\nwhile True: x @ x",
}


def suite(grid: str, scratch: Path, note: Note) -> list[Table]:
    """``corun bench shared``: each run's slowdown beside a competitor, against quiet."""
    steps = GRIDS[grid]
    subjects = [("corun run, default (free cores)", "run", "thread", 0)]
    if grid != "quick":  # a tiny grid tries every row
        subjects += [("corun run, 2 fixed threads (before)", "run", "thread", 2),
                     ("corun run, inline compute", "run", "inline", 0),
                     ("plain torch SFT loop", "plain", "inline", 0)]  # fmt: skip
    rows, ratios = [], []
    for label, what, compute, threads in subjects:
        times: dict[str, float] = {}
        for beside, code in COMPETITORS.items():
            note(f"{label}, {beside}")
            run_dir = scratch / f"shared-{what}-{compute}-{threads}-{len(times)}"
            request = {"what": what, "steps": steps, "backend": "asyncio", "compute": compute,
                       "run_dir": str(run_dir), "lane_threads": threads}  # fmt: skip
            hog = None if code is None else subprocess.Popen([sys.executable, "-c", code])
            try:
                times[beside] = statistics.median(overhead.in_fresh_process(request))
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
        quiet = times["quiet"]
        rows.append([label, *(fmt(t * 1e3) for t in times.values()),
                     *(f"{times[b] / quiet:.2f}" for b in list(COMPETITORS)[1:])])  # fmt: skip
        ratios += [(f"{label}: {b}", times[b] / quiet) for b in list(COMPETITORS)[1:]]
    return [Table(
        "shared", "slowdown", f"A short SFT run ({steps} steps) sharing the machine",
        ["run", *(f"{b}: ms/step" for b in COMPETITORS),
         *(f"slowdown, {b}" for b in list(COMPETITORS)[1:])], rows, ratios,
        "the same run on the quiet machine, same bench run",
        ["Beside it: `python -c 'while True: pass'`, or a loop of 256x256 matmuls at torch's "
         "default threads; killed after each measurement. Median step interval. The default "
         "re-reads the free cores four times a second (corun/execution/cores.py); the fixed row is "
         "`loop.lane_threads = 2`."],
    )]  # fmt: skip
