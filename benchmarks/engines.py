"""The rollout engines of an HF policy side by side on the built-in tiny model (as
the ``hf_grpo`` trainer loads it): generation throughput, weight-sync time, and the
template's share of a GRPO step. The ``engines`` suite of ``corun bench``, and a
program of its own::

    python -m benchmarks.engines                       # all three engines, ~80 s on 2 CPUs
    python -m benchmarks.engines --engines local,vllm  # without the server's 25-45 s start
    python -m benchmarks.engines --quick --json out.json  # a smoke run (the test's), ~60 s

The engines are ``trainer.engine``'s values: ``local`` (transformers, in process),
``vllm`` (in process) and ``vllm-server`` (a child process group, over HTTP).

1. **Generation** (tokens/s): one ``generate`` of ``batch`` word-problem prompts,
   ``max_tokens`` new tokens each (temperature 1, no stop ids: all run to the end), over
   its wall time. Each engine is warmed up (a call per batch size); all stay up, each
   repeat runs them in a rotated order. Medians; the ratio is to ``local``. Threads as
   in a run at concurrency > 1 (each in-process engine on its own lane, a train lane
   that has run the policy): torch's OpenMP keeps a team per OS thread, and more OpenMP
   threads than cores stop spin-waiting (vLLM alone in a process: up to 10x slower).
2. **Weight sync** (ms): ``update_weights`` with the policy's state dict after an
   untimed one; medians, engines rotated as above. Start-up time beside.
3. **GRPO step** with ``engine = "vllm"``: the template's share (benchmarks/grpo_step.py).

The server starts first, while the environment is the user's (in-process vLLM sets
``VLLM_*``). SIGINT or SIGTERM cancels everything (a second ends the process): the
engines are shut down, the server as a process group, and the GRPO child gets SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import get_args

import anyio
import msgspec
import torch

from benchmarks import grpo_step
from benchmarks.quiet import OtherLoad, rotated
from benchmarks.report import Note, Table, fmt, markdown_table
from benchmarks.setup import set_up
from corun.contract.config_file import config_from_dict
from corun.contract.engine import Engine, Sampling
from corun.engines.options import VLLMConfig
from corun.engines.start import EngineKind, Policy
from corun.engines.transformers_engine import TransformersEngine
from corun.engines.vllm_engine import VLLMEngine  # vllm itself: when started
from corun.engines.vllm_server import VLLMServerEngine
from corun.execution import procs
from corun.execution.compute import Lane

# The engines on this machine; "remote" (a fleet of servers) is the fleet suite's.
ENGINES: tuple[EngineKind, ...] = tuple(k for k in get_args(EngineKind) if k != "remote")
BASELINE: EngineKind = "local"
HF_TRAINER = {"kind": "hf_grpo", "model": "tiny-llama"}  # the built-in tiny Llama


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
GRIDS = {"full": FULL} | {
    grid: Settings(grid, (1, 8), max_tokens=8, repeats=1, syncs=2, grpo_steps=0, grpo_skip=1)
    for grid in ("quick", "tiny")
}


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


def progress(message: str) -> None:
    print(f"[engines] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- engines


async def hf_policy(prompts: int, stack: AsyncExitStack) -> tuple[Policy, int, list[list[int]]]:
    """The built-in tiny model as the ``hf_grpo`` trainer loads it (through the registry,
    set up until ``stack`` closes): its policy, pad id and ``prompts`` held-out prompts
    in its chat format."""
    run_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="corun-engines-"))
    config = config_from_dict({"run": {"dir": run_dir},
                               "trainer": {**HF_TRAINER, "eval_size": prompts}})  # fmt: skip
    trainer = await set_up(config, stack)
    chat = trainer.chat
    return trainer.policy, chat.pad_id, [chat.encode(e.prompt) for e in trainer.eval_examples]


async def start_engine(kind: EngineKind, policy: Policy, pad_id: int) -> Engine:
    """An engine on the model directory's weights (the policy's too); an in-process
    one on a lane of its own, which its shutdown closes."""
    if kind == "local":
        lane = Lane("local-engine")
        return TransformersEngine(policy, pad_id, lane, owns_lane=True, interrupt=False)
    if kind == "vllm":
        return await VLLMEngine.start(VLLMConfig(model=str(policy.source)))
    return await VLLMServerEngine.start(VLLMConfig(model=str(policy.source)))


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
    sampling = Sampling(settings.max_tokens, temperature=1.0, top_p=1.0, stop_ids=())
    order = sorted(kinds, key=lambda k: k != "vllm-server")  # the server first: see above
    train_lane = Lane("train")  # a run's OpenMP teams: see above
    engines: dict[EngineKind, Engine] = {}
    start_s: dict[EngineKind, float] = {}
    try:
        async with AsyncExitStack() as stack:  # shuts everything started down, in reverse
            policy, pad_id, prompts = await hf_policy(max(settings.batches), stack)
            await train_lane.run(torch.no_grad()(policy.model), torch.tensor(prompts[:1]))
            for kind in order:
                progress(f"starting {kind}")
                started = time.perf_counter()
                engines[kind] = await start_engine(kind, policy, pad_id)
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
    engines: dict[EngineKind, Engine], policy: Policy, settings: Settings
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


async def measure_all(
    kinds: Sequence[EngineKind], settings: Settings
) -> tuple[list[GenerationRow], list[EngineRow], grpo_step.Result | None]:
    """Everything, or KeyboardInterrupt after SIGINT or SIGTERM cancelled it. An anyio
    cancellation, not asyncio's Ctrl-C: that is a task.cancel(), which a lane call that
    ends anyway swallows (corun.Lane.run returns the result and the run goes on)."""
    done = []
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(cancel_on_signal, tasks.cancel_scope)
        generation, engines = await measure_engines(kinds, settings)
        with_grpo = settings.grpo_steps > 0 and grpo_step.ENGINE in kinds
        grpo = await grpo_step.measure(settings.grpo_steps, settings.grpo_skip, progress
                                       ) if with_grpo else None  # fmt: skip
        done.append((generation, engines, grpo))
        tasks.cancel_scope.cancel()
    if not done:
        raise KeyboardInterrupt
    return done[0]


async def cancel_on_signal(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:  # once: a second signal finds Python's handlers back
            progress(f"{signal.Signals(signum).name}: shutting everything down")
            scope.cancel()


# ----------------------------------------------------------------------------- the tables


def suite(grid: str, scratch: Path, note: Note) -> list[Table]:
    """``corun bench engines``: tokens/s and weight-sync time (the quick grids: the local
    engine only, no GRPO)."""
    settings = GRIDS[grid]
    kinds = list(ENGINES) if grid == "full" else [BASELINE]
    note(f"engines {', '.join(kinds)}, batches {settings.batches}")
    generation, syncs, _ = anyio.run(measure_all, kinds, settings)
    return tables(settings, generation, syncs)


def tables(
    settings: Settings, generation: list[GenerationRow], syncs: list[EngineRow]
) -> list[Table]:
    first_batch = settings.batches[0]
    first = {g.engine: g.tokens_per_s for g in generation if g.batch == first_batch}
    gen_table = Table(
        "engines", "generation", f"Engine tokens/s ({settings.max_tokens} new tokens a prompt)",
        ["engine", "batch", "tokens/s", f"vs {BASELINE}", f"vs batch {first_batch}"],
        [[g.engine, str(g.batch), fmt(g.tokens_per_s, 1),
          "-" if g.vs_baseline is None else f"{g.vs_baseline:.2f}",
          f"{g.tokens_per_s / first[g.engine]:.2f}"] for g in generation],
        [(f"{g.engine} batch {g.batch}", g.tokens_per_s / first[g.engine]) for g in generation],
        f"the same engine at batch {first_batch}, same run",
    )  # fmt: skip
    base_sync = statistics.median(e.sync_ms for e in syncs if e.engine == BASELINE)
    sync_table = Table(
        "engines", "sync", "Engine start and weight sync",
        ["engine", "start s", "sync ms", f"sync vs {BASELINE}"],
        [[e.engine, fmt(e.start_s, 1), fmt(e.sync_ms), f"{e.sync_ms / base_sync:.2f}"]
         for e in syncs],
        [(e.engine, e.sync_ms / base_sync) for e in syncs],
        f"the {BASELINE!r} engine's sync, same run",
    )  # fmt: skip
    return [gen_table, sync_table]


def print_report(
    settings: Settings, generation: list[GenerationRow], engines: list[EngineRow],
    grpo: grpo_step.Result | None, others: float | None, elapsed_s: float,
) -> None:  # fmt: skip
    load = "unknown" if others is None else f"{others:.2f}"
    print(f"rollout engines on the built-in tiny model ({settings.name}; {os.cpu_count()} "
          f"CPUs; other processes kept {load} CPUs busy on average); generation: temperature "
          f"1, no stop ids, median of {settings.repeats}; sync: update_weights(policy state), "
          f"median of {settings.syncs}\n")  # fmt: skip
    for table in tables(settings, generation, engines):
        print("\n".join(markdown_table(table, plot=False)))
    if grpo is not None:
        grpo_step.print_result(grpo)
    print(f"({elapsed_s:.0f} s)")


def parse_engines(text: str) -> list[EngineKind]:
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    if not chosen or set(chosen) - set(ENGINES):
        raise argparse.ArgumentTypeError(f"choose from {', '.join(ENGINES)} (got {text!r})")
    return [kind for kind in ENGINES if kind in chosen]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="a smoke run: small and short")
    add(
        "--engines",
        type=parse_engines,
        default=list(ENGINES),
        help=f"a subset of {','.join(ENGINES)} (default: all)",
    )
    add("--grpo-steps", type=int, default=None, help="GRPO steps with vllm; 0: none")
    add("--json", metavar="PATH", type=Path, help="also write the figures here")
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
