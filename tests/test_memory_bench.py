"""``corun bench memory``: the suite end to end on the test's tiny grid (its report's
tables, a row per point, every figure a positive number, a plot per table, no process
left behind), and its memory guard: a "before" point estimated past the limit is not
run, a process past the limit is stopped. Figures are never compared: timings and
sizes belong in benchmarks/."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import memory
from tests.support.processes import processes_with

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
COMPARED = ["before MiB", "after MiB", "after / before", "before s/update", "after s/update"]


def tables(section: str) -> dict[str, list[list[str]]]:
    """Each ``### title``'s markdown table: its header, then its rows, as cells."""
    found = {}
    for title, body in re.findall(r"### ([^\n]+)\n\n((?:\|[^\n]*\|\n)+)", section):
        lines = [line for line in body.splitlines() if not line.startswith("|---")]
        found[title] = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return found


def positive(cell: str) -> bool:
    return float(cell.replace(",", "")) > 0


@pytest.mark.slow  # ~40 s on 2 CPUs: 7 fresh processes, two of them corun train
def test_memory_suite_tiny_grid(tmp_path: Path) -> None:
    out, tag = tmp_path / "bench", f"corun-memory-test-{os.getpid()}"
    result = subprocess.run(
        [sys.executable, "-m", "corun", "bench", "memory", "--grid", "tiny", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "WANDB_MODE": "disabled", "CORUN_BENCHMARK_TAG": tag},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    section = (out / "report.md").read_text().split("\n## memory\n", 1)[1]
    grid = memory.GRIDS["tiny"]
    found = tables(section)
    assert len(found) == 3, list(found)
    rows, growth, end_to_end = found.values()
    assert rows[0] == ["rows", "set-up MiB", *COMPARED]
    assert [row[0] for row in rows[1:]] == [str(r) for r in grid.rows]
    least = grid.rows[0]
    assert growth[0] == [
        "rows per step", f"MiB at {grid.growth_budget} tokens", f"vs {least} rows",
        "MiB at the default budget", f"vs {least} rows (default)",
    ]  # fmt: skip
    assert [row[0] for row in growth[1:]] == [str(r) for r in grid.rows]
    assert end_to_end[0] == ["new tokens", *COMPARED]
    assert [row[0] for row in end_to_end[1:]] == [str(t) for t in grid.end_to_end]
    for table in found.values():  # nothing skipped on the tiny grid: every cell a figure
        assert all(positive(cell) for row in table[1:] for cell in row[1:]), table
    images = re.findall(r"!\[[^]]*\]\((memory-[^)]+\.png)\)", section)
    assert len(images) == 3 and section.count("Ratio (plot `") == 3
    for name in images:
        assert (out / name).read_bytes().startswith(PNG_MAGIC), name
    assert processes_with(f"CORUN_BENCHMARK_TAG={tag}".encode()) == []


def test_a_before_point_estimated_past_the_limit_is_not_run(tmp_path: Path) -> None:
    said: list[str] = []
    runner = memory.Runner(tmp_path, said.append)
    # 128 rows x 64 tokens x 151,936 logits, 4 bytes, 5 copies: 23.2 GiB.
    cell = runner.cell(memory.Point(128, 64, memory.QWEN_VOCAB, before=True))
    assert isinstance(cell, str) and cell.startswith("skipped: ~23 GiB estimated"), cell
    assert said == [] and list(tmp_path.iterdir()) == []  # no model built, no process


def test_a_process_past_the_limit_is_stopped(tmp_path: Path) -> None:
    grows = [sys.executable, "-c", "import time; held = b'x' * (512 << 20); time.sleep(60)"]
    done = memory.run_guarded(grows, 128 << 20, tmp_path / "grows")
    assert done.stopped and done.returncode != 0
    assert done.peak_mib > 128  # wait4's peak, as far as it got
    fits = [sys.executable, "-c", "held = b'x' * (64 << 20); print('done')"]
    done = memory.run_guarded(fits, 1 << 30, tmp_path / "fits")
    assert not done.stopped and done.returncode == 0 and done.stdout == "done\n"
    assert done.peak_mib > 64
