"""Smoke test: the overhead benchmark runs end to end and prints both tables (its
figures are never asserted: timings belong in benchmarks/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import processes_with

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
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


@pytest.mark.slow
def test_engines_benchmark_quick(tmp_path: Path) -> None:
    """All three engines and the GRPO breakdown, end to end; no process of the run is
    left behind (the server is a process group, the GRPO run a child)."""
    pytest.importorskip("vllm")
    stdout, figures, tag = _quick_benchmark("engines", tmp_path, timeout=600)
    assert "vs local" in stdout and "outside the hooks" in stdout
    assert {(g["engine"], g["batch"]) for g in figures["generation"]} == {
        (e, b) for e in ("local", "vllm", "vllm-server") for b in figures["settings"]["batches"]
    }
    assert all(g["tokens_per_s"] > 0 for g in figures["generation"])
    assert figures["grpo"]["intervals"] >= 1
    assert processes_with(f"CORUN_BENCHMARK_TAG={tag}".encode()) == []


@pytest.mark.slow
@pytest.mark.slow
def test_ray_workers_benchmark_quick(tmp_path: Path) -> None:
    """Ray vs thread rollout workers: per-batch overhead and weight-publish time,
    printed as ratios of one run; the local Ray it starts leaves no process behind."""
    pytest.importorskip("ray")
    stdout, figures, tag = _quick_benchmark("ray_workers", tmp_path, timeout=300)
    assert "ray/thread" in stdout and "put/in-process" in stdout
    (row,) = figures["rows"]
    assert row["thread_ms"] > 0 and row["ray_ms"] > 0 and row["put_ms"] > 0
    assert processes_with(f"CORUN_BENCHMARK_TAG={tag}".encode()) == []


def _quick_benchmark(name: str, tmp_path: Path, timeout: float) -> tuple[str, Any, str]:
    """``python -m benchmarks.<name> --quick --json``, tagged in its environment so
    that leftover processes can be found: its stdout, its figures and the tag."""
    out, tag = tmp_path / "figures.json", f"corun-{name}-test-{os.getpid()}"
    result = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--quick", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "CORUN_BENCHMARK_TAG": tag},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout, json.loads(out.read_text()), tag


@pytest.mark.slow
@pytest.mark.slow
def test_distributed_benchmark_quick(tmp_path: Path) -> None:
    """World size 1 vs 2 (torchrun, gloo): steps/s and collective time per step."""
    stdout, figures, _ = _quick_benchmark("distributed", tmp_path, timeout=300)
    assert "collective ms/step" in stdout
    assert {(r["kind"], r["nproc"]) for r in figures} == {
        (k, n) for k in ("sft", "grpo") for n in (1, 2)
    }


@pytest.mark.slow
@pytest.mark.slow
def test_endpoint_hf_benchmark_quick(tmp_path: Path) -> None:
    """The endpoint on the built-in tiny model (local engine): every concurrency with
    and without capture, and requests during verified weight syncs."""
    stdout, figures, _ = _quick_benchmark("endpoint_hf", tmp_path, timeout=300)
    assert "vs no capture" in stdout and "overlapping: extra ms" in stdout
    settings = figures["settings"]
    assert {(r["agents"], r["capture"]) for r in figures["load"]} == {
        (a, c) for a in settings["agents"] for c in (False, True)
    }
    assert all(r["tokens_per_s"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0 for r in figures["load"])
    (sync,) = figures["sync"]
    assert sync["engine"] == "local" and sync["syncs"] == settings["syncs"]
    assert sync["overlapping"] > 0 and sync["clear"] > 0


@pytest.mark.slow
@pytest.mark.slow
def test_parallel_benchmark_tiny(tmp_path: Path) -> None:
    """hf_sft at 1 rank and at 2 under ddp and fsdp (real `corun train` processes, each
    rank's memory followed), hf_grpo's full-weight and LoRA syncs; no rank left behind."""
    out, tag = tmp_path / "figures.json", f"corun-parallel-test-{os.getpid()}"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.parallel", "--grid", "tiny", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "CORUN_BENCHMARK_TAG": tag},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "params + grads + AdamW per rank" in result.stdout and "bytes sent" in result.stdout
    figures = json.loads(out.read_text())
    layouts, (full, lora, *sharded) = figures["layouts"], figures["syncs"]
    assert [(r["nproc"], r["parallel"]) for r in layouts] == [(1, "ddp"), (2, "ddp"), (2, "fsdp")]
    for run in layouts:
        assert len(run["peaks_mb"]) == run["nproc"] and min(run["peaks_mb"]) > 0, run
        assert run["step_ms"] > 0
    assert layouts[0]["weight_bytes"] > 0 and layouts[0]["optimizer_bytes"] > 0
    assert full["sync_ms"] > 0 and lora["sync_ms"] > 0
    assert 0 < lora["weight_bytes"] < full["weight_bytes"]
    assert [len(run["peaks_mb"]) for run in sharded] == [2, 2]
    assert processes_with(f"CORUN_BENCHMARK_TAG={tag}".encode()) == []


@pytest.mark.slow  # ~30 s on 2 CPUs: the server's start and 14 rounds of 6 calls a side
def test_tinker_benchmark_quick(tmp_path: Path) -> None:
    """Every call through the SDK and in process, the same work on both sides (losses
    call by call, full-length samples), and the server child stopped on the way out."""
    pytest.importorskip("tinker")
    stdout, figures, tag = _quick_benchmark("tinker", tmp_path, timeout=300)
    assert "| call | SDK p50 ms | SDK p90 ms | in process p50 ms" in stdout
    assert "overhead p50 ms" in stdout and "SDK / in process" in stdout
    rows, rounds = figures["rows"], figures["settings"]["rounds"]
    assert [r["call"] for r in rows] == ["fb1", "fb8", "optim", "step8", "sample1", "sample4"]
    for row in rows:
        assert len(row["sdk_ms"]) == len(row["direct_ms"]) == rounds, row["call"]
        assert min(row["sdk_ms"] + row["direct_ms"]) > 0, row["call"]
        assert row["sdk_p90_ms"] >= row["sdk_p50_ms"] > 0 and row["direct_p50_ms"] > 0
        assert isinstance(row["overhead_ms"], float) and row["ratio"] > 0
        assert row["label"] in stdout
    assert figures["loss_max_rel_diff"] < 1e-3  # the two models trained alike
    assert processes_with(f"CORUN_BENCHMARK_TAG={tag}".encode()) == []


@pytest.mark.slow
def test_peers_benchmark_quick(tmp_path: Path) -> None:
    """``corun bench peers --quick``: corun and TRL (as installed, and with passive
    waiting) on one GRPO job, each row measured, both final models scored."""
    pytest.importorskip("trl", reason="the peers extra (TRL) is not installed")
    out = tmp_path / "bench"
    result = subprocess.run(
        [sys.executable, "-m", "corun", "bench", "peers", "--quick", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=900,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = (out / "report.md").read_text()
    from benchmarks.peers import RUNTIMES

    assert len(RUNTIMES) == 4
    for runtime in RUNTIMES:  # a row in each table: the tiny model's, the ~50M one's
        tiny, big = [line for line in report.splitlines() if line.startswith(f"| {runtime} |")]
        for row in (tiny, big):
            cells = [cell.strip() for cell in row.strip("|").split("|")]
            assert all(float(cells[i].replace(",", "")) > 0 for i in (1, 2, 4, 5)), row
        assert "±" in tiny.split("|")[7], tiny
    assert "| advantages |" in report and "no: TRL's epsilon" in report


def test_peers_benchmark_says_when_trl_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks import peers

    monkeypatch.setattr(peers, "find_spec", lambda name: None)
    said: list[str] = []
    (table,) = peers.suite("tiny", tmp_path, said.append)
    assert said == ["TRL is not installed: pip install -c constraints-cpu.txt -e '.[peers]'"]
    assert table.rows == [] and table.notes == said
    assert list(tmp_path.iterdir()) == []  # nothing trained
