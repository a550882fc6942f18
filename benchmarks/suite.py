"""``corun bench [SUITE] [--quick] [--out DIR]``: the throughput suites, one after
another, each a call into the module that measures its topic, written up as
``report.md`` (a markdown table per suite, the machine and its load) and one PNG per
table (each row's ratio against its baseline, measured side by side in the same run)
in a run directory (default ``runs/bench-<timestamp>/``).

Here are the one registry of suites and the one argument parser: corun/host/cli.py
builds ``corun bench`` from :func:`add_arguments` and calls :func:`run`; ``python -m
benchmarks`` does the same. A suite is ``suite(grid, scratch, note) -> list[Table]``
in its topic's module: ``grid`` is "full", "quick" or "tiny" (the test's), ``scratch``
a folder for run directories, ``note`` shows a line of progress. Its imports (torch,
transformers, vLLM) wait until it runs: building the parser imports none of them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from benchmarks.report import Note, Results, Table

Suite = Callable[[str, Path, "Note"], "list[Table]"]
SUITES = {  # name: the module (benchmarks/<module>.py) whose `suite` it is
    "overhead": "overhead",
    "async": "async_throughput",
    "time_to_reward": "time_to_reward",
    "ctrl_c": "ctrl_c",
    "host_lag": "host_lag",
    "endpoint": "endpoint",
    "endpoint_hf": "endpoint_hf",
    "engines": "engines",
    "shared": "shared",
    "parallel": "parallel",
    "tinker": "tinker",
    "precision": "precision",
    "fleet": "fleet",
    "peers": "peers",
    "generation": "generation",
    "distill": "distill",
    "tinker_models": "tinker_models",
    "memory": "memory",
    "longtail": "longtail",
    "streaming": "streaming",
}
# Left out of `corun bench --quick` (every suite): each needs several model processes, an
# engine server or a trained model, and takes this long on its quick grid alone (2 quiet
# cores, 2026-12-06). Named, it runs that grid: `corun bench peers --quick`.
NOT_QUICK = {
    "parallel": "104 s: torchrun ranks, a run per layout and allocator",
    "precision": "36 s: an SFT warm start, then a GRPO run per precision",
    "fleet": "61 s: three vLLM engine servers, then two-node runs",
    "peers": "132 s: TRL and corun, four processes per model",
    "generation": "57 s: a vLLM engine process per measurement",
    "distill": "58 s: a teacher trained first, then three students",
    "tinker_models": "60 s: a process per model count, two models",
    "longtail": "166 s: six training runs, three of them on vLLM",
}
GRIDS = ("full", "quick", "tiny")
EXIT_USAGE, EXIT_INTERRUPTED = 2, 130


class UsageError(Exception):
    """A bad argument: one line, exit status 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("suite", nargs="?", default="all",
                        help=f"suite[,suite...] of {', '.join(SUITES)} (default: all)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="small grids, about 2 minutes; "
                        f"all leaves out {', '.join(NOT_QUICK)} (named, they run)")  # fmt: skip
    parser.add_argument("--out", metavar="DIR", help="the report's folder "
                        "(default runs/bench-<timestamp>)")  # fmt: skip
    parser.add_argument("--grid", choices=GRIDS, help=argparse.SUPPRESS)  # "tiny": the test's


def main_of(name: str, description: str, argv: list[str] | None = None) -> int:
    """A suite module's ``python -m benchmarks.<module> [--quick]``: ``corun bench name``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    return subprocess.call([sys.executable, "-m", "corun", "bench", name,
                            *(["--quick"] if args.quick else [])])  # fmt: skip


def suite(name: str) -> Suite:
    """The registered suite ``name``, its module imported now."""
    module = importlib.import_module(f"benchmarks.{SUITES[name]}")
    return cast(Suite, module.suite)


def run(args: argparse.Namespace) -> int:
    """The suites ``args`` name, the report and plots; 0, 1 when a suite failed, 2 on a
    bad argument (one line on stderr), 130 after Ctrl-C (KeyboardInterrupt: the report
    then has the suites done before it). Run directories (a suite's warm starts among
    them) lie where it runs, as ``corun train``'s do."""
    grid = args.grid or ("quick" if args.quick else "full")
    try:
        names, left_out = plan(args.suite, grid)
    except UsageError as exc:
        print(f"corun: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = Path(args.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    if out.exists() and not out.is_dir():
        print(f"corun: error: --out {out}: not a directory", file=sys.stderr)
        return EXIT_USAGE
    out.mkdir(parents=True, exist_ok=True)
    out = out.resolve()
    os.environ["WANDB_MODE"] = "disabled"  # whatever a recipe the suites train says
    from benchmarks.report import machine, write_report  # torch

    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _interrupt)
    info, started = machine(), time.monotonic()
    results, failures = _run_suites(names, grid, out)
    info["load average after (1/5/15 min)"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    report = write_report(out, grid, info, results, time.monotonic() - started, failures,
                          left_out)  # fmt: skip
    print(f"corun: bench report: {report}")
    for name, error in failures.items():
        print(f"corun: error: suite {name}: {error}", file=sys.stderr)
    if "interrupted" in failures.values():
        return EXIT_INTERRUPTED
    return 1 if failures else 0


def _run_suites(names: list[str], grid: str, out: Path) -> tuple[Results, dict[str, str]]:
    """Each suite in turn, its tables and its load, or why it failed; its plots in
    ``out``. Ctrl-C stops at the suite it interrupts."""
    from benchmarks.report import LoadWatch, plot

    results: Results = {}
    failures: dict[str, str] = {}
    with (
        tempfile.TemporaryDirectory(prefix="corun-bench-") as scratch,
        _progress() as progress,
    ):
        overall = progress.add_task("corun bench", total=len(names), detail="")
        for name in names:
            progress.update(overall, description=name, detail="")
            folder = Path(scratch) / name
            folder.mkdir()
            note = _note(progress, overall, name)
            watch, suite_started = LoadWatch().start(), time.monotonic()
            try:
                tables = suite(name)(grid, folder, note)
            except KeyboardInterrupt:  # Ctrl-C: the report of the suites done so far
                failures[name] = "interrupted"
                watch.stop()
                break
            except Exception as exc:  # a broken suite: reported, the others still run
                traceback.print_exc()
                failures[name] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
                watch.stop()
            else:
                load = watch.stop() | {"elapsed_s": time.monotonic() - suite_started}
                results[name] = (tables, load)
                for table in tables:
                    if table.ratios:  # a table of figures alone has no plot
                        plot(out, table)
            progress.advance(overall)
    return results, failures


def _interrupt(signum: int, frame: object) -> None:
    """Ctrl-C as KeyboardInterrupt, wherever the main thread is: asyncio's own handler
    (installed by a suite's ``anyio.run`` over Python's default one) only cancels the
    main task, which a measurement waiting on a lane may never notice."""
    raise KeyboardInterrupt


def plan(text: str, grid: str) -> tuple[list[str], dict[str, str]]:
    """The suites that ``text`` (``all`` or names, comma-separated) runs on ``grid``, and
    those left out with why: on the quick grid, ``all`` leaves out :data:`NOT_QUICK`; a
    suite named runs whatever its grid costs."""
    if text == "all" and grid == "quick":
        return [name for name in SUITES if name not in NOT_QUICK], dict(NOT_QUICK)
    return _suites(text), {}


def _suites(text: str) -> list[str]:
    if text == "all":
        return list(SUITES)
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in SUITES]
    if unknown or not chosen:
        raise UsageError(f"unknown suite {text!r} (choose from all, {', '.join(SUITES)})")
    return chosen


def _note(progress: Progress, task: TaskID, suite: str) -> Note:
    """A suite's progress: on the bar on a terminal, a plain line on stderr otherwise."""
    if progress.disable:
        return lambda text: print(f"corun: bench {suite}: {text}", file=sys.stderr, flush=True)
    return lambda text: progress.update(task, detail=text)


def _progress() -> Progress:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]{task.description:<15}"), BarColumn(), TextColumn("{task.completed}/"
        "{task.total}"), TimeElapsedColumn(), TextColumn("{task.fields[detail]}"),
        console=Console(stderr=True), transient=False, disable=not sys.stderr.isatty(),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="corun bench", description="the throughput suites: report.md and plots in a folder"
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
