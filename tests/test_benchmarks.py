"""Smoke test: the overhead benchmark runs end to end and prints both tables (its
figures are never asserted: timings belong in benchmarks/)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_overhead_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.overhead", "--quick", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "runtime cost per step" in result.stdout and "SFT step" in result.stdout
    figures = json.loads(out.read_text())
    assert {(r["backend"], r["compute"]) for r in figures["sft"]} == {
        (b, c) for b in ("asyncio", "trio") for c in ("thread", "inline")
    }
    assert all(r["us_per_step"] > 0 for r in figures["noop"])


def test_async_throughput_benchmark_quick() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.async_throughput", "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.strip().endswith("%")]
    assert {row[1] for row in rows} == {"sync", "start", "completion", "fixed"}
