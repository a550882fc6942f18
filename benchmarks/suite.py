"""``corun bench [SUITE] [--quick] [--out DIR]``: the throughput suites, one after
another, each a call into the benchmark module that measures it, written up as
``report.md`` (a markdown table per suite, the machine and its load) and one PNG per
table (each row's ratio against its baseline, measured side by side in the same run)
in a run directory (default ``runs/bench-<timestamp>/``).

corun/host/cli.py dispatches here (corun itself never imports benchmarks); ``python -m
benchmarks.suite ...`` does the same.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ["WANDB_MODE"] = "disabled"

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from benchmarks import suites, suites_proc
from benchmarks.bench_report import LoadWatch, Table, machine, plot, write_report

Suite = Callable[[str, Path, Callable[[str], None]], list[Table]]
SUITES: dict[str, Suite] = {
    "overhead": suites.suite_overhead,
    "async": suites.suite_async,
    "time_to_reward": suites_proc.suite_time_to_reward,
    "ctrl_c": suites_proc.suite_ctrl_c,
    "host_lag": suites.suite_host_lag,
    "endpoint": suites.suite_endpoint,
    "engines": suites.suite_engines,
    "shared": suites_proc.suite_shared,
}
GRIDS = ("full", "quick", "tiny")
ROOT = Path(__file__).resolve().parents[1]


class UsageError(Exception):
    """A bad argument: one line, exit status 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("suite", nargs="?", default="all",
                        help=f"one of {', '.join(SUITES)} (default: all)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="small grids: all in ~2 minutes")
    parser.add_argument("--out", metavar="DIR", help="the report's folder "
                        "(default runs/bench-<timestamp>)")  # fmt: skip
    parser.add_argument("--grid", choices=GRIDS, help=argparse.SUPPRESS)  # "tiny": the test's


def run(args: argparse.Namespace) -> int:
    """The suites ``args`` name, the report and plots; 0, 1 when a suite failed, 2 on a
    bad argument (one line on stderr), 130 after Ctrl-C (KeyboardInterrupt: the report
    then has the suites done before it)."""
    try:
        names = _suites(args.suite)
    except UsageError as exc:
        print(f"corun: error: {exc}", file=sys.stderr)
        return 2
    grid = args.grid or ("quick" if args.quick else "full")
    out = Path(args.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    if out.exists() and not out.is_dir():
        print(f"corun: error: --out {out}: not a directory", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    out = out.resolve()
    os.chdir(ROOT)  # the suites name configs/... and their prerequisite runs/... from here
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _interrupt)
    info = machine()
    started = time.monotonic()
    results: dict[str, tuple[list[Table], dict[str, Any]]] = {}
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
                tables = SUITES[name](grid, folder, note)
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
                    plot(out, table)
            progress.advance(overall)
    info["load average after (1/5/15 min)"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    report = write_report(out, grid, info, results, time.monotonic() - started, failures)
    print(f"corun: bench report: {report}")
    for name, error in failures.items():
        print(f"corun: error: suite {name}: {error}", file=sys.stderr)
    if "interrupted" in failures.values():
        return 130
    return 1 if failures else 0


def _interrupt(signum: int, frame: object) -> None:
    """Ctrl-C as KeyboardInterrupt, wherever the main thread is: asyncio's own handler
    (installed by a suite's ``anyio.run`` over Python's default one) only cancels the
    main task, which a measurement waiting on a lane may never notice."""
    raise KeyboardInterrupt


def _suites(text: str) -> list[str]:
    if text == "all":
        return list(SUITES)
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in SUITES]
    if unknown or not chosen:
        raise UsageError(f"unknown suite {text!r} (choose from all, {', '.join(SUITES)})")
    return chosen


def _note(progress: Progress, task: TaskID, suite: str) -> Callable[[str], None]:
    """A suite's progress: on the bar on a terminal, a plain line on stderr otherwise."""
    if progress.disable:
        return lambda text: print(f"corun: bench {suite}: {text}", file=sys.stderr, flush=True)
    return lambda text: progress.update(task, detail=text)


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description:<15}"), BarColumn(), TextColumn("{task.completed}/"
        "{task.total}"), TimeElapsedColumn(), TextColumn("{task.fields[detail]}"),
        console=Console(stderr=True), transient=False, disable=not sys.stderr.isatty(),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="corun bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
