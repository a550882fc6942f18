"""``corun bench``'s in-process suites: each calls an existing benchmark module's
measuring functions and returns :class:`~benchmarks.bench_report.Table` s.

A suite is ``suite(grid, scratch, note) -> list[Table]``: ``grid`` is "full", "quick"
or "tiny" (the test's), ``scratch`` a folder for run directories, ``note`` shows a
line of progress."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

import anyio

from benchmarks import async_throughput, endpoint, host_lag, overhead
from benchmarks.bench_report import Table, fmt
from benchmarks.overhead_report import Settings
from benchmarks.quiet import Guarded

Note = Callable[[str], None]

OVERHEAD = {
    "full": overhead.FULL,
    "quick": Settings("quick", 200, 1, 10, 1, plain_between=False, retries=0),
    "tiny": Settings("tiny", 50, 1, 4, 1, plain_between=False, retries=0),
}


def suite_overhead(grid: str, scratch: Path, note: Note) -> list[Table]:
    """The template's own cost per step (no-op trainer) per backend and compute, and the
    SFT step through ``corun.run`` against a plain PyTorch loop (benchmarks/overhead.py)."""
    settings = OVERHEAD[grid]
    note(f"no-op trainer, {settings.noop_steps} steps x 4 variants")
    in_process = Guarded(overhead.measure, settings.retries)  # retries: the full grid's
    noop = overhead.measure_noop(settings, scratch, in_process)
    base = next(r.us_per_step for r in noop if (r.backend, r.compute) == ("asyncio", "thread"))
    noop_table = Table(
        "overhead", "noop", "Template cost per step (no-op trainer)",
        ["backend", "compute", "µs per step", "vs asyncio/thread"],
        [[r.backend, r.compute, fmt(r.us_per_step, 0), f"{r.us_per_step / base:.2f}"]
         for r in noop],
        [(f"{r.backend}/{r.compute}", r.us_per_step / base) for r in noop],
        "asyncio with thread compute (the default), same run",
    )  # fmt: skip
    # The test's grid measures SFT in this process: fast, but thread compute after a plain
    # loop pays for a second OpenMP thread team (see benchmarks/overhead.py).
    measure_one = in_process if grid == "tiny" else Guarded(overhead.in_fresh_process,
                                                            settings.retries)  # fmt: skip
    note(f"SFT through run vs a plain loop, {settings.sft_steps} steps")
    sft = overhead.measure_sft(settings, scratch, measure_one, noop)
    sft_table = Table(
        "overhead", "sft", "SFT step (configs/sft.toml model) through corun.run vs a plain loop",
        ["backend", "compute", "plain ms", "run ms", "run / plain", "template share"],
        [[r.backend, r.compute, fmt(r.plain_ms), fmt(r.run_ms), f"{r.run_ms / r.plain_ms:.3f}",
          f"{r.template_pct:.1f} %"] for r in sft.rows],
        [(f"{r.backend}/{r.compute}", r.run_ms / r.plain_ms) for r in sft.rows],
        "the plain PyTorch loop, measured in the same run",
        [f"A plain measurement lies {sft.noise_pct:.1f} % from the plain median (noise); "
         f"{measure_one.retried} measurement(s) repeated for other processes' load, "
         f"{measure_one.disturbed} still disturbed."
         + (" Measured in this process (test grid)." if grid == "tiny" else "")],
    )  # fmt: skip
    return [noop_table, sft_table]


ASYNC = {  # train step s, steps, gen/train ratios, worker counts
    "full": (0.05, 40, (0.5, 1.0, 2.0, 4.0), (1, 2, 4)),
    "quick": (0.02, 12, (1.0, 2.0), (1, 2)),
    "tiny": (0.01, 8, (2.0,), (2,)),
}


def suite_async(grid: str, scratch: Path, note: Note) -> list[Table]:
    """Sync vs async steps/s with latency-only fakes, as a fraction of the ideal bound
    ``1 / max(gen / workers, train)`` (sync: ``1 / (gen + train)``)."""
    train_s, steps, ratios, worker_counts = ASYNC[grid]
    rows, labels = [], []
    for ratio in ratios:
        generate_s = ratio * train_s
        sync_rate = 0.0
        for order, workers in [("sync", 1), *(("start", w) for w in worker_counts)]:
            note(f"gen/train {ratio:g}, {order}, {workers} worker(s)")
            rate, measured, staleness = async_throughput.measure(
                generate_s, train_s, workers, order, steps, "asyncio"
            )
            bound = 1 / (generate_s + train_s if order == "sync" else max(generate_s / workers,
                                                                          train_s))  # fmt: skip
            sync_rate = sync_rate or rate
            mode = "sync" if order == "sync" else f"async, {workers} worker(s)"
            rows.append([f"{ratio:g}", mode, fmt(rate, 1), fmt(bound, 1), f"{rate / bound:.1%}",
                         f"{rate / measured:.1%}", f"{rate / sync_rate:.2f}",
                         f"{staleness:.2f}"])  # fmt: skip
            labels.append((f"g/t {ratio:g} {mode}", rate / bound))
    return [Table(
        "async", "bound", f"Steps/s against the ideal bound (latency-only fakes, train step "
        f"{train_s * 1e3:g} ms, {steps} steps, asyncio)",
        ["gen / train", "mode", "steps/s", "bound", "of bound", "of measured bound", "vs sync",
         "staleness"], rows, labels,
        "the ideal bound 1 / max(gen / workers, train) (sync: 1 / (gen + train))",
    )]  # fmt: skip


HOST_LAG = {  # idle seconds, overrides
    "full": (3.0, []),
    "quick": (0.5, host_lag.QUICK["overrides"]),
    "tiny": (0.3, ["run.steps=8", "loop.eval_interval=4", "loop.save_interval=4"]),
}


def suite_host_lag(grid: str, scratch: Path, note: Note) -> list[Table]:
    """How late a host task's 1 ms sleeps wake up, idle and while corun trains
    configs/sft.toml in its task group (benchmarks/host_lag.py), asyncio and trio."""
    idle_s, overrides = HOST_LAG[grid]
    rows, ratios = [], []
    for backend in ("asyncio", "trio") if grid == "full" else ("asyncio",):
        note(f"{backend}: idle {idle_s:g} s, then training")
        request = {"backend": backend, "compute": "thread", "idle_s": idle_s, "retries": 0,
                   "overrides": overrides, "explain": False, "tree": str(overhead.ROOT),
                   "run_dir": str(scratch / f"host-lag-{backend}")}  # fmt: skip
        r = host_lag.in_fresh_process(request)
        idle, training = r["idle"], r["training"]
        rows.append([backend, fmt(idle["p99_ms"]), fmt(training["p50_ms"]),
                     fmt(training["p99_ms"]), fmt(training["max_ms"], 1),
                     str(training["over_5ms"]), fmt(r["steps_per_s"], 1)])  # fmt: skip
        ratios.append((f"{backend} p99 training / idle", training["p99_ms"] / idle["p99_ms"]))
    return [Table(
        "host_lag", "lag", "Host loop lag (1 ms sleeps) while training configs/sft.toml",
        ["backend", "idle p99 ms", "training p50 ms", "training p99 ms", "training max ms",
         "> 5 ms", "steps/s"], rows, ratios,
        "the same host loop idle, just before the run (p99)",
    )]  # fmt: skip


ENDPOINT = {"full": 256, "quick": 64, "tiny": 32}


def suite_endpoint(grid: str, scratch: Path, note: Note) -> list[Table]:
    """Endpoint completion tokens/s at 1, 8 and 32 concurrent agents (benchmarks/endpoint.py)."""
    total = ENDPOINT[grid]
    note(f"{total} requests at 1, 8, 32 agents")
    rows, raw = anyio.run(endpoint.measure, total, 2.0)
    base = rows[0][1]
    raw_rate = dict(raw)
    return [Table(
        "endpoint", "agents", f"Endpoint tokens/s by concurrent agents ({total} requests each, "
        "batching window 2 ms)",
        ["agents", "tokens/s", "vs 1 agent", "generation calls", "without HTTP, tokens/s"],
        [[str(a), fmt(rate, 0), f"{rate / base:.2f}", str(calls), fmt(raw_rate[a], 0)]
         for a, rate, calls in rows],
        [(f"{a} agent(s)", rate / base) for a, rate, _ in rows],
        "one agent at a time, same endpoint, same run",
    )]  # fmt: skip


def suite_engines(grid: str, scratch: Path, note: Note) -> list[Table]:
    """Rollout engines' generation tokens/s and weight-sync time on the built-in tiny
    Llama (benchmarks/engines.py); the quick grids measure the local engine only."""
    from benchmarks import engines  # transformers and vLLM: imported only for this suite

    settings = engines.FULL if grid == "full" else engines.Settings(
        grid, (1, 8), max_tokens=8, repeats=1, syncs=2, grpo_steps=0,
        grpo_skip=1)  # fmt: skip
    kinds = list(engines.ENGINES) if grid == "full" else [engines.BASELINE]
    note(f"engines {', '.join(kinds)}, batches {settings.batches}")
    generation, syncs, _ = anyio.run(engines.measure_all, kinds, settings)
    first_batch = settings.batches[0]
    first = {g.engine: g.tokens_per_s for g in generation if g.batch == first_batch}
    gen_table = Table(
        "engines", "generation", f"Engine tokens/s ({settings.max_tokens} new tokens a prompt)",
        ["engine", "batch", "tokens/s", f"vs {engines.BASELINE}", f"vs batch {first_batch}"],
        [[g.engine, str(g.batch), fmt(g.tokens_per_s, 1),
          "-" if g.vs_baseline is None else f"{g.vs_baseline:.2f}",
          f"{g.tokens_per_s / first[g.engine]:.2f}"] for g in generation],
        [(f"{g.engine} batch {g.batch}", g.tokens_per_s / first[g.engine]) for g in generation],
        f"the same engine at batch {settings.batches[0]}, same run",
    )  # fmt: skip
    base_sync = statistics.median(e.sync_ms for e in syncs if e.engine == engines.BASELINE)
    sync_table = Table(
        "engines", "sync", "Engine start and weight sync",
        ["engine", "start s", "sync ms", f"sync vs {engines.BASELINE}"],
        [[e.engine, fmt(e.start_s, 1), fmt(e.sync_ms), f"{e.sync_ms / base_sync:.2f}"]
         for e in syncs],
        [(e.engine, e.sync_ms / base_sync) for e in syncs],
        f"the {engines.BASELINE!r} engine's sync, same run",
    )  # fmt: skip
    return [gen_table, sync_table]
