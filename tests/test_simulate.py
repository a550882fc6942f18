"""``corun simulate``: the real loop template on a virtual clock (corun/sim/simulate.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from corun.base.config import Config
from corun.host import cli
from corun.loop.clock import Clock
from corun.records.events import read_records
from corun.sim.simfit import fit
from corun.sim.simulate import simulate, simulation_config


def _config(tmp_path: Path, text: str, *overrides: str, fitted: Any = None) -> Config:
    path = tmp_path / "sim.toml"
    path.write_text(text)
    return simulation_config(path, list(overrides), fitted, out=tmp_path / "out")


# Deterministic lengths: a rollout takes overhead + gen_tokens / tokens_per_s = 2.25 s.
SYNC = """
[run]
steps = 40
[loop]
baseline_eval = false
[data]
batch_size = 4
[simulate]
gen_tokens = 100.0
gen_sigma = 0.0
tokens_per_s = 50.0
rollout_overhead_s = 0.25
train_s = 1.0
sync_s = 0.5
"""

ASYNC = """
[run]
steps = 60
[loop]
concurrency = 8
workers = 4
max_staleness = 8
baseline_eval = false
[data]
batch_size = 4
[simulate]
gen_tokens = 100.0
gen_sigma = 0.0
tokens_per_s = 50.0
train_s = 0.6
"""


def test_a_simulation_writes_a_real_runs_records_on_virtual_time(tmp_path: Path) -> None:
    config = _config(
        tmp_path, ASYNC, "run.steps=12", "loop.eval_interval=4", "loop.save_interval=6",
        "simulate.eval_s=3.0", "simulate.sync_s=0.1", "simulate.gen_sigma=0.8",
        "loop.order=completion", "loop.max_staleness=1",
    )  # fmt: skip
    summary = simulate(config)
    run_dir = config.run_dir
    metrics = read_records(run_dir / "metrics.jsonl")
    keys = set().union(*metrics)
    for key in (
        "perf/rollout_time_s", "perf/train_time_s", "perf/trainer_idle_ratio",
        "perf/generator_idle_ratio", "perf/sync_time_s", "perf/eval_time_s",
        "async/staleness_mean", "async/staleness_max", "async/inflight", "async/dropped",
    ):  # fmt: skip
        assert key in keys, key
    # Virtual time, exactly: no real time leaks into the loop's measurements.
    for key, seconds in (("perf/train_time_s", 0.6), ("perf/eval_time_s", 3.0)):
        assert {round(m[key], 9) for m in metrics if key in m} == {seconds}
    events = read_records(run_dir / "events.jsonl")
    names = [e["event"] for e in events]
    assert names[0] == "start" and names[-1] == "end" and events[-1]["reason"] == "done"
    assert {"step", "sync", "eval", "save", "checkpoint_written"} <= set(names)
    assert events[0]["t"] == 0.0 and events[-1]["t"] < 1e4  # from 0, not the epoch
    assert (run_dir / "checkpoints" / "step-12").is_dir()
    trace = json.loads((run_dir / "trace.json").read_text())  # valid JSON: Perfetto opens it
    spans = {r["name"] for r in trace if r["ph"] == "X"}
    assert {"rollout", "train", "sync", "eval"} <= spans
    assert summary["steps"] == 12 and summary["staleness_max"] <= 1
    assert summary["dropped"] == names.count("drop")


def test_the_simulation_runs_the_real_admission_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No second implementation: the simulation admits through corun.loop.clock.Clock, and
    changing the clock's rule changes the simulation."""
    calls = []
    admit = Clock.admit

    async def counting(self: Clock) -> int:
        calls.append(self.slots)
        return await admit(self)

    monkeypatch.setattr(Clock, "admit", counting)
    free = simulate(_config(tmp_path, ASYNC))
    events = read_records(tmp_path / "out" / "events.jsonl")
    assert len(calls) >= sum(e["event"] == "step" for e in events) == 60

    # One batch at a time, whatever the config says: the run becomes synchronous.
    monkeypatch.setattr(Clock, "admissible", lambda self: self.slots - self.done < 1)
    serial = simulate(_config(tmp_path, ASYNC))
    assert free["steps_per_s"] == pytest.approx(1 / 0.6, rel=0.02)
    assert serial["steps_per_s"] == pytest.approx(1 / (2.0 + 0.6), rel=0.01)


def test_a_sync_simulation_matches_the_analytic_rate(tmp_path: Path) -> None:
    summary = simulate(_config(tmp_path, SYNC))
    assert summary["steps_per_s"] == pytest.approx(1 / (2.25 + 1.0 + 0.5), rel=0.01)
    assert summary["trainer_idle_ratio"] == pytest.approx(2.25 / 3.75, rel=0.01)
    assert summary["staleness_max"] == 0 and summary["dropped"] == 0


@pytest.mark.parametrize(("train_s", "bound"), [(0.6, 1 / 0.6), (0.3, 4 / 2.0)])
def test_async_approaches_its_bound(tmp_path: Path, train_s: float, bound: float) -> None:
    """1 / max(generation time / workers, train time)."""
    summary = simulate(_config(tmp_path, ASYNC, f"simulate.train_s={train_s}"))
    assert summary["steps_per_s"] == pytest.approx(bound, rel=0.03)


def test_a_fit_reproduces_the_run_it_was_fitted_to(tmp_path: Path) -> None:
    """Long-tailed generation, agentic turns with tool calls: a simulation fitted to
    another's records predicts its throughput."""
    first = simulate(
        _config(
            tmp_path,
            ASYNC,
            "simulate.gen_sigma=1.0",
            "simulate.turns=3",
            "simulate.tool_s=0.2",
            "simulate.tool_tail_prob=0.1",
            "simulate.tool_tail_factor=10",
            "simulate.sync_s=0.05",
        )
    )
    fitted = fit(tmp_path / "out")
    assert fitted["sync_s"] == pytest.approx(0.05)
    refit = simulate(simulation_config(_write(tmp_path, ASYNC), [], fitted, out=tmp_path / "refit"))
    assert refit["steps_per_s"] == pytest.approx(first["steps_per_s"], rel=0.1)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fit.toml"
    path.write_text(text)
    return path


def test_corun_simulate_prints_a_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, SYNC)
    out = tmp_path / "cli"
    assert cli.main(["simulate", str(path), "run.steps=10", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "steps/s (virtual)" in printed and "trainer idle ratio" in printed
    assert (out / "trace.json").exists()
    # A folder the simulator did not make is never cleared.
    assert cli.main(["simulate", str(path), "--out", str(tmp_path)]) == 2


def test_a_thousand_workers_for_a_thousand_steps(tmp_path: Path) -> None:
    """The question it exists for, in seconds: 1,000 rollout workers, 4,096 prompts per
    step, a 30 s sync (staleness bounded, so most workers wait for admission)."""
    config = _config(
        tmp_path, ASYNC, "run.steps=1000", "loop.concurrency=1000", "loop.workers=1000",
        "loop.max_staleness=4", "data.batch_size=4096", "simulate.gen_tokens=512.0",
        "simulate.gen_sigma=0.6", "simulate.tokens_per_s=30.0", "simulate.slots=256",
        "simulate.train_s=60.0", "simulate.sync_s=30.0",
    )  # fmt: skip
    started = time.perf_counter()
    summary = simulate(config)
    wall = time.perf_counter() - started
    print(f"1000 workers x 1000 steps: {wall:.2f} s wall")
    assert summary["steps"] == 1000 and summary["staleness_max"] <= 4
    assert summary["steps_per_s"] == pytest.approx(1 / 90.0, rel=0.01)  # trainer-bound
    assert wall < 120  # generous: about 1 s on an idle core


@pytest.mark.parametrize(("inflight", "period_s"), [("interrupt", 2.0), ("drain", 2.0 + 0.5)])
def test_a_draining_sync_waits_for_the_generation_in_flight(
    tmp_path: Path, inflight: str, period_s: float
) -> None:
    """One worker, a batch ahead: in flight, generation never stops (a step every 2 s of
    generation); a draining sync waits for the batch being generated, and the next one
    starts only after the sync's 0.5 s."""
    summary = simulate(_config(
        tmp_path, ASYNC, "loop.concurrency=2", "loop.workers=1", "simulate.train_s=0.5",
        "simulate.sync_s=0.5", f"simulate.inflight_at_sync={inflight}",
    ))  # fmt: skip
    assert summary["steps_per_s"] == pytest.approx(1 / period_s, rel=0.02)
