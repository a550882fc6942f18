"""``corun bench``'s report: the tables the suites return, the machine they ran on,
``report.md`` and one PNG per table (its ratios against the baseline measured beside
them in the same run)."""

from __future__ import annotations

import os
import platform
import textwrap
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.quiet import OtherLoad

Note = Callable[[str], None]  # a suite's line of progress


@dataclass
class Table:
    """One figure: rows of measured values, and for each row a ratio against the
    baseline named in ``baseline`` (measured in the same run, or a bound)."""

    suite: str
    name: str  # a file name stem: <suite>-<name>.png
    title: str
    columns: list[str]
    rows: list[list[str]]
    ratios: list[tuple[str, float]]  # (row label, value / baseline)
    baseline: str  # what a ratio of 1 means
    notes: list[str] = field(default_factory=list)


def fmt(value: float, digits: int = 2) -> str:
    return f"{value:,.{digits}f}"


class LoadWatch:
    """The 1-minute load average sampled every second from :meth:`start` to :meth:`stop`,
    and how many CPUs other processes kept busy meanwhile (benchmarks/quiet.py)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._others = OtherLoad()
        self.others: float | None = None

    def _sample(self) -> None:
        while not self._stop.wait(1.0):
            self.samples.append(os.getloadavg()[0])

    def start(self) -> LoadWatch:
        self._others = OtherLoad()
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        self.others = self._others.stop()
        during = self.samples or [os.getloadavg()[0]]
        return {"load_mean": sum(during) / len(during), "load_max": max(during),
                "others_cpus": self.others}  # fmt: skip


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    return {
        "cpus": os.cpu_count(),
        "usable cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch threads": torch.get_num_threads(),
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "load average before (1/5/15 min)": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def markdown_grid(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A header and rows as a markdown table's lines."""
    lines = [f"| {' | '.join(columns)} |", f"|{'---|' * len(columns)}"]
    return lines + [f"| {' | '.join(row)} |" for row in rows]


def markdown_table(table: Table, plot: bool = True) -> list[str]:
    """The table as markdown, with what its ratios are against (and its plot's name)."""
    lines = [f"### {table.title}", "", *markdown_grid(table.columns, table.rows)]
    where = f" (plot `{table.suite}-{table.name}.png`)" if plot else ""
    lines += [""]
    if table.baseline:  # a table of figures alone has no ratio
        lines += [f"Ratio{where}: against {table.baseline}."]
    lines += [f"{note}" for note in table.notes]
    return [*lines, ""]


Results = dict[str, tuple[list[Table], dict[str, Any]]]  # suite: (tables, its load)


def write_report(
    out: Path, grid: str, info: dict[str, Any], suites: Results, elapsed_s: float,
    failures: dict[str, str], left_out: dict[str, str] | None = None,
) -> Path:  # fmt: skip
    """``report.md`` in ``out``: the machine, each suite's tables (and plots), the suites
    that failed, and those ``left_out`` of a quick run with why (name: reason)."""
    lines = ["# corun bench", "", f"Grid: `{grid}`; {elapsed_s:.0f} s in all.", ""]
    lines += ["## Machine", ""]
    lines += ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in info.items()]
    lines.append("")
    for suite, (tables, load) in suites.items():
        others = load["others_cpus"]
        busy = "unknown" if others is None else f"{others:.2f}"
        lines += [f"## {suite}", "", f"Load average during: mean {load['load_mean']:.2f}, max "
                  f"{load['load_max']:.2f}; other processes kept {busy} CPUs busy; "
                  f"{load['elapsed_s']:.1f} s.", ""]  # fmt: skip
        for table in tables:
            lines += markdown_table(table)
            lines += [f"![{table.title}]({table.suite}-{table.name}.png)", ""]
    for suite, error in failures.items():
        lines += [f"## {suite}", "", f"**failed**: `{error}`", ""]
    if left_out:
        lines += ["## Not in --quick", "", "Too slow for the quick run, each on its quick grid "
                  "alone (`corun bench NAME --quick` runs one):", ""]  # fmt: skip
        lines += [f"- {suite}: {why}" for suite, why in left_out.items()] + [""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def plot(out: Path, table: Table) -> Path:
    """A horizontal bar per row: its ratio against the baseline, with the line at 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label for label, _ in table.ratios]
    values = [value for _, value in table.ratios]
    figure, axes = plt.subplots(figsize=(8, 0.45 * len(values) + 2))
    bars = axes.barh(range(len(values)), values, color="tab:blue")
    axes.set_yticks(range(len(values)), labels, fontsize=8)
    axes.invert_yaxis()
    axes.axvline(1.0, color="black", linewidth=1, linestyle="--")
    axes.bar_label(bars, [f"{v:.2f}" for v in values], fontsize=8, padding=2)
    axes.set_xlabel(textwrap.fill(f"ratio against {table.baseline}", 100), fontsize=8)
    axes.set_title(textwrap.fill(table.title, 90), fontsize=9)
    axes.set_xlim(0, max([1.0, *values]) * 1.2)
    figure.tight_layout()
    path = out / f"{table.suite}-{table.name}.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
