"""The rollout engines of an HF policy side by side on the built-in tiny model:
generation throughput, weight-sync time, and the template's share of a GRPO step.

Run from the repository root::

    python -m benchmarks.engines                       # all three engines, ~80 s on 2 CPUs
    python -m benchmarks.engines --engines local,vllm  # without the server's 25-45 s start
    python -m benchmarks.engines --quick --json out.json  # a smoke run (the test's), ~60 s

The engines are ``trainer.engine``'s values: ``local`` (transformers, in process),
``vllm`` (in process) and ``vllm-server`` (a child process group, over HTTP).

1. **Generation** (tokens/s): one ``generate`` of ``batch`` word-problem prompts,
   ``max_tokens`` new tokens each (temperature 1, no stop ids: all run to the end), over
   its wall time (HTTP included). Each engine is warmed up first (a call per batch
   size); all stay up, and each repeat runs them in a rotated order, so load from other
   processes falls on all alike. Medians; the ratio is to ``local`` in the same run.
   Threads as in a run at concurrency > 1: each in-process engine on its own lane, and
   a train lane that has run the policy. It matters: torch's OpenMP keeps a thread team
   per OS thread, and with more OpenMP threads than cores idle ones stop spin-waiting,
   much faster under load (vLLM alone in the process measured up to 10x slower here).
2. **Weight sync** (ms): ``update_weights`` with the policy's state dict after an
   untimed one; medians, engines rotated as above. Start-up time beside.
3. **GRPO step** (``hf_grpo``, ``engine = "vllm"``, concurrency 1, no eval): ``corun
   train`` in a child process, on a config built here. Each step interval (``t`` of
   the ``step`` events) against the hooks in it (``metrics.jsonl``: the last step's
   sync, this step's rollout and train); the rest is the template's share. The rollout
   splits into generate, reward and the trainer's own code (prompts, batch).

The server starts first, while the environment is the user's (in-process vLLM sets
``VLLM_*`` in ``os.environ``). SIGINT or SIGTERM cancels everything (a second one ends
the process): the engines are shut down, the server as a process group, and the GRPO
child, a process group too, gets SIGTERM (its own graceful teardown). Nothing is
asserted: timings belong in benchmarks. The CPUs other processes kept busy are printed
(roughly: the server counts until it is reaped).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass
from itertools import pairwise
from pathlib import Path
from typing import get_args

os.environ["WANDB_MODE"] = "disabled"

import anyio
import msgspec
import torch

import corun
from benchmarks.quiet import OtherLoad
from corun.base.config import to_toml
from corun.contract.engine import Engine, Sampling
from corun.execution import procs
from corun.records.events import EVENTS_FILE, METRICS_FILE, read_records
from trainers.hf.engine import TransformersEngine
from trainers.hf.engines import EngineKind
from trainers.hf.policy import ChatFormat, HFPolicy, load_policy
from trainers.hf.tasks import eval_problems
from trainers.hf.tiny import built_in
from trainers.hf.vllm_engine import VLLMConfig, VLLMEngine  # vllm itself: when started
from trainers.hf.vllm_server import VLLMServerEngine

ENGINES: tuple[EngineKind, ...] = get_args(EngineKind)  # local, vllm, vllm-server
BASELINE: EngineKind = "local"
GRPO_ENGINE: EngineKind = "vllm"
GRPO_PROMPTS, GRPO_SAMPLES = 16, 8  # 128 sequences a step, max_new_tokens (8) each
GRPO_TRAINER = {"kind": "hf_grpo", "model": "tiny-llama", "engine": GRPO_ENGINE,
                "samples_per_prompt": GRPO_SAMPLES, "lr": 1e-3}  # fmt: skip


@dataclass(frozen=True)
class Settings:
    name: str
    batches: tuple[int, ...]  # prompts per generate call
    max_tokens: int  # new tokens per prompt (all of them: no stop ids)
    repeats: int  # generate calls per engine and batch size, after the warm-up
    syncs: int  # timed weight syncs per engine, after an untimed one
    grpo_steps: int
    grpo_skip: int  # first step intervals left out of the GRPO figures (warm-up)


FULL = Settings("full", (1, 8, 64), max_tokens=32, repeats=11, syncs=11, grpo_steps=40, grpo_skip=3)
QUICK = Settings("quick", (1, 8), max_tokens=8, repeats=2, syncs=3, grpo_steps=5, grpo_skip=1)


@dataclass
class GenerationRow:
    engine: str
    batch: int
    tokens_per_s: float  # median over the repeats
    vs_baseline: float | None  # tokens_per_s / the baseline's at this batch size
    spread: float  # (max - min) / median of the samples
    samples: list[float]


@dataclass
class EngineRow:
    engine: str
    start_s: float
    sync_ms: float  # median
    samples_ms: list[float]


@dataclass
class GRPOResult:
    steps: int
    intervals: int  # step intervals the figures are taken over
    mean_ms: dict[str, float]  # step, then its parts; the parts sum to the step
    outside_share_median: float  # per-step (step - hooks) / step, median
    setup_s: float  # run start to the end of setup (model, vLLM start, weight sync)


def progress(message: str) -> None:
    print(f"[engines] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- engines


async def start_engine(kind: EngineKind, policy: HFPolicy, pad_id: int, model: Path) -> Engine:
    """An engine on the model directory's weights (the policy's too); an in-process
    one on a lane of its own, which its shutdown closes."""
    if kind == "local":
        lane = corun.Lane("local-engine")
        return TransformersEngine(policy, pad_id, lane, owns_lane=True, interrupt=False)
    if kind == "vllm":
        return await VLLMEngine.start(VLLMConfig(model=str(model)))
    return await VLLMServerEngine.start(VLLMConfig(model=str(model)))


def rotated(kinds: Sequence[EngineKind], k: int) -> list[EngineKind]:
    """A different engine goes first in each repeat, so none always runs in the same slot."""
    return [*kinds[k % len(kinds) :], *kinds[: k % len(kinds)]]


async def tokens_per_s(
    engine: Engine, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int
) -> float:
    started = time.perf_counter()
    generations = await engine.generate(prompts, sampling, seed)
    elapsed = time.perf_counter() - started
    tokens = sum(len(g.ids) for g in generations)
    if tokens != len(prompts) * sampling.max_tokens:  # no stop ids: every one runs to the end
        raise RuntimeError(f"{tokens} tokens for {len(prompts)} x {sampling.max_tokens}")
    return tokens / elapsed


async def measure_engines(
    kinds: Sequence[EngineKind], settings: Settings
) -> tuple[list[GenerationRow], list[EngineRow]]:
    model = built_in()
    policy, tokenizer = load_policy(f"hf:{model}", "the built-in model")
    chat = ChatFormat(tokenizer)
    prompts = [chat.encode(e.prompt) for e in eval_problems(max(settings.batches))]
    sampling = Sampling(settings.max_tokens, temperature=1.0, top_p=1.0, stop_ids=())
    order = sorted(kinds, key=lambda k: k != "vllm-server")  # the server first: see above
    train_lane = corun.Lane("train")  # a run's OpenMP teams: see above
    engines: dict[EngineKind, Engine] = {}
    start_s: dict[EngineKind, float] = {}
    try:
        await train_lane.run(torch.no_grad()(policy.model), torch.tensor(prompts[:1]))
        async with AsyncExitStack() as stack:  # shuts every started engine down, in reverse
            for kind in order:
                progress(f"starting {kind}")
                started = time.perf_counter()
                engines[kind] = await start_engine(kind, policy, chat.pad_id, model)
                stack.push_async_callback(engines[kind].shutdown)
                start_s[kind] = time.perf_counter() - started
                for batch in settings.batches:  # warm-up, untimed
                    await engines[kind].generate(prompts[:batch], sampling, seed=0)
                progress(f"{kind} up in {start_s[kind]:.1f} s, warmed up")
            generation = await measure_generation(engines, prompts, sampling, settings)
            syncs = await measure_syncs(engines, policy, settings)
    finally:
        train_lane.close()
    medians = {k: statistics.median(s) for k, s in syncs.items()}
    return generation, [EngineRow(k, round(start_s[k], 2), medians[k], syncs[k]) for k in kinds]


async def measure_generation(
    engines: dict[EngineKind, Engine], prompts: list[list[int]], sampling: Sampling,
    settings: Settings,
) -> list[GenerationRow]:  # fmt: skip
    kinds = list(engines)
    rows: list[GenerationRow] = []
    for batch in settings.batches:
        samples: dict[EngineKind, list[float]] = {k: [] for k in kinds}
        for repeat in range(settings.repeats):
            for kind in rotated(kinds, repeat):
                rate = await tokens_per_s(engines[kind], prompts[:batch], sampling, repeat + 1)
                samples[kind].append(round(rate, 1))
                progress(f"generate {kind:<11} batch {batch:>2} repeat "
                         f"{repeat + 1}/{settings.repeats}: {rate:8.1f} tok/s")  # fmt: skip
        medians = {k: statistics.median(s) for k, s in samples.items()}
        base = medians.get(BASELINE)
        for kind in sorted(kinds, key=ENGINES.index):
            median, got = medians[kind], samples[kind]
            rows.append(GenerationRow(
                kind, batch, median, None if base is None else round(median / base, 3),
                round((max(got) - min(got)) / median, 3), got,
            ))  # fmt: skip
    return rows


async def measure_syncs(
    engines: dict[EngineKind, Engine], policy: HFPolicy, settings: Settings
) -> dict[EngineKind, list[float]]:
    samples: dict[EngineKind, list[float]] = {k: [] for k in engines}
    for engine in engines.values():
        await engine.update_weights(policy.weights(), 1)  # untimed: first-call costs
    for repeat in range(settings.syncs):
        for kind in rotated(list(engines), repeat):
            started = time.perf_counter()
            await engines[kind].update_weights(policy.weights(), repeat + 2)
            samples[kind].append(round((time.perf_counter() - started) * 1e3, 3))
            progress(f"sync {kind:<11} repeat {repeat + 1}/{settings.syncs}: "
                     f"{samples[kind][-1]:7.1f} ms")  # fmt: skip
    return samples


# ----------------------------------------------------------------------------- GRPO


def start_grpo(scratch: Path, steps: int) -> corun.ChildProcess:
    """``corun train`` in its own process group, on a config built here; a log beside."""
    config = corun.config_from_dict({
        "run": {"name": "engines-grpo", "dir": str(scratch / "run"), "steps": steps},
        "loop": {"concurrency": 1, "baseline_eval": False, "eval_interval": 0},
        "log": {"progress": "off", "wandb": "disabled"},
        "data": {"batch_size": GRPO_PROMPTS}, "trainer": GRPO_TRAINER,
    })  # fmt: skip
    (scratch / "grpo.toml").write_text(to_toml(config))
    with open(scratch / "grpo.log", "wb") as log:
        argv = [sys.executable, "-m", "corun.host.cli", "train", str(scratch / "grpo.toml")]
        return corun.ChildProcess(argv, stdin=subprocess.DEVNULL, stdout=log,
                                  stderr=subprocess.STDOUT)  # fmt: skip


def grpo_breakdown(scratch: Path, code: int, skip: int) -> GRPOResult:
    """Each step interval against the hooks that ran in it (at concurrency 1 they run
    one after another: the previous step's sync, then this step's rollout and train)."""
    if code != 0:
        log = (scratch / "grpo.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"corun train (GRPO) exited with status {code}:\n{log}")
    run_dir = scratch / "run"
    events = read_records(run_dir / EVENTS_FILE)
    step_t = {e["step"]: e["t"] for e in events if e["event"] == "step"}
    setup_s = next(e["t"] for e in events if e["event"] == "setup") - events[0]["t"]
    metrics: dict[int, dict[str, float]] = {}
    for record in read_records(run_dir / METRICS_FILE):
        metrics.setdefault(record["step"], {}).update(record)
    parts: dict[str, list[float]] = {}
    shares = []
    for prev, step in list(pairwise(sorted(step_t)))[skip:]:
        m, wall = metrics[step], step_t[step] - step_t[prev]
        hooks = {
            "generate": m["perf/generate_time_s"],
            "reward": m["perf/reward_time_s"],
            "rollout, other": m["perf/rollout_time_s"] - m["perf/generate_time_s"]
            - m["perf/reward_time_s"],
            "train": m["perf/train_time_s"],
            "sync": metrics[prev]["perf/sync_time_s"],
        }  # fmt: skip
        outside = wall - sum(hooks.values())
        shares.append(outside / wall)
        for name, seconds in {"step": wall, **hooks, "outside the hooks": outside}.items():
            parts.setdefault(name, []).append(seconds)
    means = {name: round(statistics.fmean(s) * 1e3, 3) for name, s in parts.items()}
    return GRPOResult(len(step_t), len(shares), means,
                      round(statistics.median(shares), 4), round(setup_s, 2))  # fmt: skip


async def measure_grpo(settings: Settings) -> GRPOResult:
    """On any way out the run gets SIGTERM (it tears its engine down), SIGKILL after 30 s."""
    progress(f"GRPO with engine {GRPO_ENGINE!r}: {settings.grpo_steps} steps")
    with tempfile.TemporaryDirectory(prefix="corun-engines-") as scratch:
        child = start_grpo(Path(scratch), settings.grpo_steps)
        try:
            while (code := child.popen.poll()) is None:  # noqa: ASYNC110 (another process)
                await anyio.sleep(0.1)
        finally:
            with anyio.CancelScope(shield=True):  # at once if it has exited
                await anyio.to_thread.run_sync(child.stop, 30.0)
        result = grpo_breakdown(Path(scratch), code, settings.grpo_skip)
    progress(f"GRPO: step {result.mean_ms['step']:.1f} ms, outside the hooks "
             f"{result.outside_share_median:.1%}")  # fmt: skip
    return result


async def measure_all(
    kinds: Sequence[EngineKind], settings: Settings
) -> tuple[list[GenerationRow], list[EngineRow], GRPOResult | None]:
    """Everything, or KeyboardInterrupt after SIGINT or SIGTERM cancelled it. An anyio
    cancellation, not asyncio's Ctrl-C: that is a task.cancel(), which a lane call that
    ends anyway swallows (corun.Lane.run returns the result and the run goes on)."""
    done = []
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(cancel_on_signal, tasks.cancel_scope)
        generation, engines = await measure_engines(kinds, settings)
        with_grpo = settings.grpo_steps > 0 and GRPO_ENGINE in kinds
        done.append((generation, engines, await measure_grpo(settings) if with_grpo else None))
        tasks.cancel_scope.cancel()
    if not done:
        raise KeyboardInterrupt
    return done[0]


async def cancel_on_signal(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:  # once: a second signal finds Python's handlers back
            progress(f"{signal.Signals(signum).name}: shutting everything down")
            scope.cancel()


# ----------------------------------------------------------------------------- report


def print_report(
    settings: Settings, generation: list[GenerationRow], engines: list[EngineRow],
    grpo: GRPOResult | None, others: float | None, elapsed_s: float,
) -> None:  # fmt: skip
    load = "unknown" if others is None else f"{others:.2f}"
    print(f"rollout engines on the built-in tiny model ({settings.name}; {os.cpu_count()} "
          f"CPUs; other processes kept {load} CPUs busy on average)")  # fmt: skip
    print(f"\ngeneration: {settings.max_tokens} new tokens per prompt, temperature 1, no "
          f"stop ids; median of {settings.repeats}; ratio against {BASELINE!r}")  # fmt: skip
    print(f"{'engine':<12} {'batch':>5} {'tok/s':>9} {'vs ' + BASELINE:>9} {'spread':>7}")
    for g in generation:
        ratio = "-" if g.vs_baseline is None else f"{g.vs_baseline:.2f}x"
        print(f"{g.engine:<12} {g.batch:5d} {g.tokens_per_s:9.1f} {ratio:>9} {g.spread:7.0%}")
    print(f"\nweight sync: update_weights(policy state), median of {settings.syncs}")
    print(f"{'engine':<12} {'start s':>8} {'sync ms':>9}")
    for e in engines:
        print(f"{e.engine:<12} {e.start_s:8.1f} {e.sync_ms:9.2f}")
    if grpo is not None:
        print(f"\nGRPO step, engine {GRPO_ENGINE!r} (hf_grpo, {GRPO_PROMPTS} prompts x "
              f"{GRPO_SAMPLES} samples, concurrency 1): mean over {grpo.intervals} step "
              f"intervals (of {grpo.steps} steps; setup {grpo.setup_s:.1f} s)")  # fmt: skip
        step = grpo.mean_ms["step"]
        for name, ms in grpo.mean_ms.items():
            print(f"  {name:<18} {ms:9.2f} ms {ms / step:7.1%}")
        print(f"  the template's share of a step (outside the hooks), per-step median: "
              f"{grpo.outside_share_median:.2%}")  # fmt: skip
    print(f"({elapsed_s:.0f} s)")


def parse_engines(text: str) -> list[EngineKind]:
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    if not chosen or set(chosen) - set(ENGINES):
        raise argparse.ArgumentTypeError(f"choose from {', '.join(ENGINES)} (got {text!r})")
    return [kind for kind in ENGINES if kind in chosen]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: small and short")
    parser.add_argument("--engines", type=parse_engines, default=list(ENGINES),
                        help=f"a subset of {','.join(ENGINES)} (default: all)")  # fmt: skip
    parser.add_argument("--grpo-steps", type=int, default=None,
                        help="GRPO steps with vllm; 0: none")  # fmt: skip
    parser.add_argument("--json", metavar="PATH", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.grpo_steps is not None:
        if 0 < args.grpo_steps < settings.grpo_skip + 2:
            parser.error(f"--grpo-steps: 0 (skip) or at least {settings.grpo_skip + 2}")
        settings = Settings(**{**asdict(settings), "grpo_steps": args.grpo_steps})
    started, others = time.monotonic(), OtherLoad()
    try:
        generation, engines, grpo = anyio.run(measure_all, args.engines, settings)
    except KeyboardInterrupt:  # the engines and the GRPO child were stopped on the way out
        return 130
    finally:
        procs.kill_all()  # the last resort: a server group whose start was interrupted
    elapsed_s, load = time.monotonic() - started, others.stop()
    print_report(settings, generation, engines, grpo, load, elapsed_s)
    if args.json is not None:
        figures = {"settings": asdict(settings), "cpus": os.cpu_count(),
                   "other_processes_cpus": load, "elapsed_s": round(elapsed_s, 1),
                   "generation": [asdict(g) for g in generation],
                   "engines": [asdict(e) for e in engines],
                   "grpo": None if grpo is None else asdict(grpo)}  # fmt: skip
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(figures)) + b"\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
