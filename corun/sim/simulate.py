"""``corun simulate``: the real loop template on a virtual clock, against latency models.

What runs is :func:`corun.loop.template.run` itself — admission, the staleness bound, the
version schedule, drops and requeues, sync/eval/save cadence, checkpoints, events,
metrics and the trace — with a :class:`SimulatedTrainer` whose hooks only wait:
``rollout`` sleeps the batch's sampled generation time, ``train_step`` the train time,
``sync_weights`` the sync time, ``evaluate`` the eval time. The run is on trio with
``trio.testing.MockClock(autojump_threshold=0)``: when every task waits, virtual time
jumps to the next wake-up, so a day of training takes seconds. Compute is inline (no
threads: a thread's real time would let the clock jump past it), and the run's time
base (corun/base/timebase.py) reads the mock clock, so every ``perf/*`` metric, event time
and trace span is virtual time from 0.

The latency model (a ``[simulate]`` table in the config; ``--fit RUN_DIR`` fills it
from a real run, corun/sim/simfit.py). A rollout worker (``loop.workers``) generates a
whole batch of ``prompts`` x ``samples_per_prompt`` episodes, dealt round-robin over
its ``engines`` engine replicas (1,000 GPUs serving 4 batches in flight: ``workers =
4``, ``engines = 250``). An episode has ``turns`` model turns of L tokens each, L ~ lognormal(median
``gen_tokens``, sigma ``gen_sigma``) capped at ``max_tokens``, decoded at
``tokens_per_s`` per sequence, with a tool call of ``tool_s`` between turns (``tool_tail_prob``
of them ``tool_tail_factor`` times as long). An engine runs up to ``slots`` episodes
at once (0: all of them), so a batch takes ``rollout_overhead_s + max(longest episode,
busiest engine's episode time / slots)``: the batch waits for its slowest episode (the
long tail) and, on full engines, for their work (continuous batching's lower bound).
Given ``rollout_times_s`` (measured batch times), the rollout of data index i takes
entry i mod n (attempt a of it: i + a), so every measured time is used equally, their
tail included; ``train_times_s`` likewise
replaces the constant ``train_s``, step by step. Saves cost no virtual time (tiny real
writes; the snapshot, the one part on the loop, is not modelled). A weight sync takes
``sync_s``; with ``inflight_at_sync = "drain"`` it first waits for every rollout in
flight, and rollouts wait for it (a batch is the unit: the sync waits for the batch's
longest episode), as a draining engine does; "interrupt" (the default) waits for none.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio
import msgspec
import numpy as np

from corun.base import timebase
from corun.base.config import Config as CorunConfig
from corun.base.config import TrainerConfig, apply_override
from corun.base.errors import ConfigError
from corun.contract.config_file import config_from_dict
from corun.contract.trainer import Batch, Metrics, RolloutContext, Trainer
from corun.loop.template import run
from corun.records.events import EVENTS_FILE, METRICS_FILE, TRACE_FILE, read_records

KIND = "corun.sim.simulate:SimulatedTrainer"
MARKER = ".corun-simulate"  # a folder holding it is the simulator's to clear
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Positive = Annotated[float, msgspec.Meta(gt=0)]


class SimulateConfig(TrainerConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The latency model: the ``[simulate]`` table (module docstring)."""

    kind: str = KIND
    prompts: Annotated[int, msgspec.Meta(ge=0)] = 0  # per step; 0: data.batch_size
    samples_per_prompt: Annotated[int, msgspec.Meta(ge=1)] = 1
    gen_tokens: Positive = 512.0  # median tokens per model turn
    gen_sigma: NonNegative = 0.6  # lognormal sigma of the length: the tail
    max_tokens: Positive = 8192.0
    tokens_per_s: Positive = 30.0  # decode speed of one sequence
    engines: Annotated[int, msgspec.Meta(ge=1)] = 1  # replicas per rollout worker
    slots: Annotated[int, msgspec.Meta(ge=0)] = 0  # episodes an engine runs at once
    rollout_overhead_s: NonNegative = 0.0  # per batch: prefill, scoring
    turns: Annotated[int, msgspec.Meta(ge=1)] = 1  # model turns per episode
    tool_s: NonNegative = 0.0  # each tool call between turns
    tool_tail_prob: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    tool_tail_factor: Annotated[float, msgspec.Meta(ge=1)] = 1.0
    rollout_times_s: tuple[NonNegative, ...] = ()  # measured batch times, in turn
    train_s: NonNegative = 1.0  # per batch (step)
    train_times_s: tuple[NonNegative, ...] = ()  # measured train times, in turn
    sync_s: NonNegative = 0.0
    eval_s: NonNegative = 0.0
    # A weight sync and the generations in flight: "interrupt" (the new weights between
    # two decode steps: the sync waits for none) or "drain" (it waits for every running
    # rollout, and no rollout starts until it is done), as trainer.inflight_at_sync.
    inflight_at_sync: Literal["interrupt", "drain"] = "interrupt"


class SimulatedTrainer(Trainer[SimulateConfig]):
    """A trainer whose hooks only take (virtual) time; everything else is the runtime's."""

    Config = SimulateConfig

    def __init__(self, config: CorunConfig) -> None:
        super().__init__(config)
        self.seed = config.run.seed
        self.episodes = (self.config.prompts or config.data.batch_size) * (
            self.config.samples_per_prompt
        )
        self._trained = 0
        self._generating = 0  # rollouts running now
        self._drained: anyio.Event | None = None  # a draining sync waits on it
        self._syncing: anyio.Event | None = None  # a draining sync runs: rollouts wait

    async def rollout(self, inputs: Any, ctx: RolloutContext) -> Batch:
        seconds = self.rollout_time(ctx.index, ctx.attempt)
        while self._syncing is not None:
            await self._syncing.wait()
        self._generating += 1
        try:
            await anyio.sleep(seconds)
        finally:
            self._generating -= 1
            if not self._generating and self._drained is not None:
                self._drained.set()
        return Batch(None)

    def rollout_time(self, index: int, attempt: int = 0) -> float:
        """The generation time of data index ``index`` (its ``attempt``-th start)."""
        cfg = self.config
        if cfg.rollout_times_s:
            return cfg.rollout_times_s[(index + attempt) % len(cfg.rollout_times_s)]
        draws = np.random.default_rng([self.seed, index, attempt])
        n, turns = self.episodes, cfg.turns
        lengths = np.minimum(
            draws.lognormal(np.log(cfg.gen_tokens), cfg.gen_sigma, (n, turns)), cfg.max_tokens
        )
        episode_s = lengths.sum(axis=1) / cfg.tokens_per_s
        if turns > 1 and cfg.tool_s > 0:
            tails = draws.random((n, turns - 1)) < cfg.tool_tail_prob
            tools = np.where(tails, cfg.tool_s * cfg.tool_tail_factor, cfg.tool_s)
            episode_s = episode_s + tools.sum(axis=1)
        longest = float(episode_s.max())
        if cfg.slots and n > cfg.slots:
            engine_s = np.bincount(np.arange(n) % cfg.engines, weights=episode_s)
            longest = max(longest, float(engine_s.max()) / cfg.slots)
        return cfg.rollout_overhead_s + longest

    async def train_step(self, batch: Batch) -> Metrics:
        times, self._trained = self.config.train_times_s, self._trained + 1
        await anyio.sleep(times[(self._trained - 1) % len(times)] if times else self.config.train_s)
        return {}

    async def sync_weights(self, version: int) -> None:
        if self.config.inflight_at_sync == "interrupt":
            await anyio.sleep(self.config.sync_s)
            return
        syncing = self._syncing = anyio.Event()
        try:
            if self._generating:  # the longest generation in flight ends first
                self._drained = anyio.Event()
                await self._drained.wait()
            await anyio.sleep(self.config.sync_s)
        finally:
            self._drained = self._syncing = None
            syncing.set()

    async def evaluate(self) -> Metrics:
        await anyio.sleep(self.config.eval_s)
        return {}


# ----------------------------------------------------------------------------- config


def simulation_config(
    path: str | Path, overrides: list[str] | tuple[str, ...] = (),
    fitted: dict[str, Any] | None = None, out: str | Path | None = None,
) -> CorunConfig:  # fmt: skip
    """``path``'s loop and run settings with the simulated trainer: its ``[simulate]``
    table, updated by ``fitted`` (a fit), then by the ``simulate.*`` overrides. The
    output goes to ``out`` (default ``runs/simulate/<run.name>``)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config ({exc})") from None
    raw["simulate"] = {**raw.get("simulate", {}), **(fitted or {})}
    for override in overrides:
        apply_override(raw, override)
    sim = raw.pop("simulate")
    if not isinstance(sim, dict):
        raise ConfigError(f"{path}: `$.simulate` must be a table")
    raw["trainer"] = {**sim, "kind": KIND}
    run_raw = raw.setdefault("run", {})
    run_raw.update(backend="trio", nproc=1)
    run_raw["dir"] = str(out or Path("runs/simulate") / str(run_raw.get("name", "run")))
    raw.setdefault("loop", {})["compute"] = "inline"
    raw.setdefault("log", {}).update(wandb="disabled", progress="off")
    raw.pop("serve", None)
    raw.pop("rollout", None)
    return config_from_dict(raw, source=str(path), overrides=overrides)


def _fresh(run_dir: Path) -> None:
    """Empty the output folder: a simulation never resumes. Only one it made itself."""
    if run_dir.exists() and any(run_dir.iterdir()):
        if not (run_dir / MARKER).exists():
            raise ConfigError(
                f"{run_dir}: exists and is not a simulation's output; pick another --out"
            )
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / MARKER).touch()


# ----------------------------------------------------------------------------- run


def simulate(config: CorunConfig) -> dict[str, float]:
    """Run ``config`` (from :func:`simulation_config`) on the virtual clock; return
    :func:`summarize` of its run directory."""
    from trio.testing import MockClock

    _fresh(config.run_dir)
    clock = MockClock(autojump_threshold=0)
    trainer = SimulatedTrainer(config)

    async def main() -> None:
        with timebase.virtual(clock.current_time):
            await run(trainer, config)

    anyio.run(main, backend="trio", backend_options={"clock": clock})
    return summarize(config.run_dir, config.loop.workers if config.loop.concurrency > 1 else 1)


def summarize(run_dir: str | Path, workers: int) -> dict[str, float]:
    """Throughput, staleness and idle shares of a run directory, real or simulated.

    Steady state: from the first step's event to the last (set-up, the baseline eval
    and the first rollout are left out). Idle ratios are the loop's own
    ``perf/*_idle_ratio``, weighted by each step's duration; ``worker_busy_ratio`` is
    the rollout spans' share of the workers' time in the trace.
    """
    run_dir = Path(run_dir)
    events = read_records(run_dir / EVENTS_FILE)
    steps = {e["step"]: e["t"] for e in events if e["event"] == "step"}
    metrics = [m for m in read_records(run_dir / METRICS_FILE) if "perf/train_time_s" in m]
    if len(steps) < 2:
        raise ValueError(f"{run_dir}: fewer than 2 steps, nothing to measure")
    first, last = min(steps), max(steps)
    span = steps[last] - steps[first]
    out: dict[str, float] = {"steps": float(last), "steps_per_s": (last - first) / span}
    weighted: dict[str, float] = {}
    for m in metrics:
        step = m["step"]
        if step > first and step - 1 in steps:
            dt = steps[step] - steps[step - 1]
            for key in ("perf/trainer_idle_ratio", "perf/generator_idle_ratio"):
                weighted[key] = weighted.get(key, 0.0) + m[key] * dt
    for key, total in weighted.items():
        out[key.removeprefix("perf/")] = total / span
    staleness = [m["async/staleness_mean"] for m in metrics if "async/staleness_mean" in m]
    out["staleness_mean"] = float(np.mean(staleness)) if staleness else 0.0
    out["staleness_max"] = float(max(staleness, default=0.0))
    out["dropped"] = float(sum(e["event"] == "drop" for e in events))
    for key in ("rollout", "train"):
        times = [m[f"perf/{key}_time_s"] for m in metrics if f"perf/{key}_time_s" in m]
        out[f"{key}_time_mean_s"] = float(np.mean(times)) if times else 0.0
    busy = 0.0
    start, end = steps[first] * 1e6, steps[last] * 1e6
    for span_record in _spans(run_dir / TRACE_FILE, "rollout"):
        lo, hi = span_record["ts"], span_record["ts"] + span_record["dur"]
        busy += max(0.0, min(hi, end) - max(lo, start))
    out["worker_busy_ratio"] = busy / (workers * (end - start))
    return out


def _spans(path: Path, name: str) -> list[dict[str, Any]]:
    text = path.read_text().rstrip().rstrip(",")
    records = msgspec.json.decode(text if text.endswith("]") else text + "]")
    return [r for r in records if r.get("name") == name and r.get("ph") == "X"]


def report(summary: dict[str, float], run_dir: Path, wall_s: float) -> str:
    """The printed summary of a simulation."""
    lines = [
        f"corun simulate: {summary['steps']:.0f} steps in {wall_s:.2f} s wall; "
        f"records in {run_dir} (trace.json opens in Perfetto; times are virtual)",
        f"  steps/s (virtual)        {summary['steps_per_s']:.4g}",
        f"  staleness mean / max     {summary['staleness_mean']:.3g} / "
        f"{summary['staleness_max']:.0f}",
        f"  trainer idle ratio       {summary.get('trainer_idle_ratio', 0.0):.3f}",
        f"  generator idle ratio     {summary.get('generator_idle_ratio', 0.0):.3f}",
        f"  worker busy ratio        {summary['worker_busy_ratio']:.3f}",
        f"  dropped batches          {summary['dropped']:.0f}",
        f"  rollout / train mean s   {summary['rollout_time_mean_s']:.4g} / "
        f"{summary['train_time_mean_s']:.4g}",
    ]
    return "\n".join(lines)


def cli_main(
    path: str, overrides: list[str], fit_dir: str | None = None, out: str | None = None
) -> int:
    """``corun simulate CONFIG [KEY.PATH=VALUE ...] [--fit RUN_DIR] [--out DIR]``."""
    import time

    fitted = None
    if fit_dir is not None:
        from corun.sim.simfit import fit

        fitted = fit(fit_dir)
    config = simulation_config(path, overrides, fitted, out)
    started = time.perf_counter()
    summary = simulate(config)
    print(report(summary, config.run_dir, time.perf_counter() - started))
    return 0
