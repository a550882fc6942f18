"""A short SFT run sharing the machine: the ``shared`` suite of ``corun bench``. The
same run (the ``sft`` recipe's model, in a fresh process) on the quiet machine, with
one busy process beside it, and with a plain torch loop beside it: corun's default
(the machine's cores as a fixed thread count, torch's threads sleeping at barriers)
against ``loop.adapt_threads`` with spinning threads (the free cores, re-read: corun's
default before), and in the full grid 2 fixed spinning threads (torch's own default),
inline compute and a plain torch SFT loop."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks import overhead
from benchmarks.report import Note, Table, fmt

GRIDS = {"full": 80, "quick": 12, "tiny": 5}  # steps
# label, what, compute, loop.lane_threads, loop.adapt_threads, OMP_WAIT_POLICY
SUBJECTS = [
    ("corun run, default (fixed threads, passive waits)", "run", "thread", 0, False, "PASSIVE"),
    ("corun run, adapt_threads (free cores, spinning: before)", "run", "thread", 0, True,
     "ACTIVE"),
    ("corun run, 2 fixed threads, spinning", "run", "thread", 2, False, "ACTIVE"),
    ("corun run, inline compute", "run", "inline", 0, False, "PASSIVE"),
    ("plain torch SFT loop, spinning", "plain", "inline", 0, False, "ACTIVE"),
]  # fmt: skip
COMPETITORS = {  # what runs beside the measurement: a command, killed after
    "quiet": None,
    "one busy process": "while True: pass",
    "a plain torch loop": "import torch\nx = torch.randn(256, 256)\nwhile True: x @ x",
}


def suite(grid: str, scratch: Path, note: Note) -> list[Table]:
    """``corun bench shared``: each run's slowdown beside a competitor, against quiet."""
    steps = GRIDS[grid]
    # The quick grid: today's default and the one before it, beside a busy process alone;
    # a tiny grid tries every row.
    subjects = SUBJECTS if grid != "quick" else SUBJECTS[:2]
    competitors = COMPETITORS if grid != "quick" else dict(list(COMPETITORS.items())[:2])
    rows, ratios = [], []
    for index, (label, what, compute, threads, adapt, policy) in enumerate(subjects):
        times: dict[str, float] = {}
        for beside, code in competitors.items():
            note(f"{label}, {beside}")
            run_dir = scratch / f"shared-{index}-{len(times)}"
            request = {"what": what, "steps": steps, "backend": "asyncio", "compute": compute,
                       "run_dir": str(run_dir), "lane_threads": threads,
                       "adapt_threads": adapt, "env": {"OMP_WAIT_POLICY": policy}}  # fmt: skip
            hog = None if code is None else subprocess.Popen([sys.executable, "-c", code])
            try:
                times[beside] = statistics.median(overhead.in_fresh_process(request))
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
        quiet = times["quiet"]
        rows.append([label, *(fmt(t * 1e3) for t in times.values()),
                     *(f"{times[b] / quiet:.2f}" for b in list(competitors)[1:])])  # fmt: skip
        ratios += [(f"{label}: {b}", times[b] / quiet) for b in list(competitors)[1:]]
    return [Table(
        "shared", "slowdown", f"A short SFT run ({steps} steps) sharing the machine",
        ["run", *(f"{b}: ms/step" for b in competitors),
         *(f"slowdown, {b}" for b in list(competitors)[1:])], rows, ratios,
        "the same run on the quiet machine, same bench run",
        ["Beside it: `python -c 'while True: pass'`, or a loop of 256x256 matmuls at torch's "
         "default threads; killed after each measurement. Median step interval. The default "
         "keeps the machine's cores as its thread count and lets torch's threads sleep at "
         "barriers (`OMP_WAIT_POLICY=PASSIVE`); `loop.adapt_threads` re-reads the free cores "
         "four times a second (corun/execution/cores.py); spinning: `OMP_WAIT_POLICY=ACTIVE`."],
    )]  # fmt: skip
