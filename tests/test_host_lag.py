"""Smoke test: the host-lag benchmark runs end to end on asyncio and trio, with its
spike attribution (its figures are never asserted: timings belong in benchmarks/)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_host_lag_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.host_lag", "--quick", "--explain", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "p99 ms" in result.stdout and "wake-ups later than" in result.stdout
    figures = json.loads(out.read_text())
    assert {(r["backend"], r["compute"]) for r in figures} == {
        ("asyncio", "thread"),
        ("trio", "thread"),
    }
    for r in figures:
        assert r["outcome"] == "done"
        assert r["idle"]["ticks"] > 0 and r["training"]["ticks"] > 0 and r["steps_per_s"] > 0
        assert {"lag_ms", "queued_ms", "ran_ms", "blocked_ms"} <= r["tail"].keys()
        assert all({"cause", "span", "lag_ms"} <= s.keys() for s in r["spikes"])
