"""Streamed replies: time to first token (TTFT) and inter-token latency (ITL) of
streamed chat requests, before (the whole reply generated, then its chunks sent: the
endpoint's old way, kept behind corun/serve/streaming.py's benchmark-only
``WHOLE_REPLY``; on the transformers engine also a call at a time, as before it batched
continuously) and after (each decode step's tokens sent as they are sampled), both in
this run. The tiny Llama as ``hf_grpo`` serves it (benchmarks/endpoint_hf.py's
``served``), on the transformers engine (``local``) and on vLLM in process (``vllm``);
short and long replies. The ``streaming`` suite of ``corun bench``, and::

    python -m benchmarks.streaming            # local and vllm
    python -m benchmarks.streaming --quick    # local only, small

The client is a standard-style streaming client (as ``vllm bench serve``'s
openai-chat backend measures): ``requests`` streamed chat requests, ``concurrency`` at a
time, TTFT from sending to the first content delta, ITL the gaps between content
deltas; p50 and p99. It runs in the endpoint's process (its event loop), so its own
work adds to both sides equally.

The full grid adds the headline: ``corun serve hf_agentic`` (the SFT-trained agent,
``trainer.engine`` local and vllm) in a process of its own, before and after, driven by
vLLM's own serving-benchmark client (``vllm bench serve``, benchmarks/vllm_client.py)
in another: 200 streamed chat requests of 32 random prompt tokens, 32 at a time, each
reply run to its length (``ignore_eos``), short and long; on the transformers engine
also streamed a call at a time (streaming without continuous batching). Nothing is
asserted about timings.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio
import httpx

from benchmarks.endpoint_hf import MODEL, percentile, served
from benchmarks.report import Note, Table, fmt
from benchmarks.serve_child import serving
from corun.execution.http import sse_events
from corun.serve import streaming


@dataclass(frozen=True)
class Settings:
    engines: tuple[str, ...]
    requests: int
    concurrency: int
    lengths: tuple[int, ...]  # max_tokens: short, long


GRIDS = {
    "full": Settings(("local", "vllm"), 200, 32, (16, 128)),
    "quick": Settings(("local",), 24, 8, (8, 48)),
    "tiny": Settings(("local",), 8, 4, (4, 16)),
}
HEADLINE = Settings(("local", "vllm", "vllm-server"), 200, 32, (16, 128))  # the full grid's
RECIPE = "hf_agentic"
PROMPT_TOKENS = 32
CLIENT_S = 600.0
WHOLE_PRELUDE = "import corun.serve.streaming as s\ns.WHOLE_REPLY = True"
# Before continuous batching on the transformers engine, the endpoint handed it a call
# at a time and gathered the requests that arrived meanwhile into the next: its "before"
# does so again (a served policy whose continuous_batching is always False).
ONE_CALL_PRELUDE = (
    "import corun.agents.served as a\n"
    "a.EnginePolicy.continuous_batching = property(lambda self: False, lambda self, on: None)"
)


# The child's code for each way of serving: before (whole replies; the transformers
# engine a call at a time), after, and on the transformers engine streamed a call at a
# time (streaming before continuous batching: what each of the two changes gives).
PRELUDES = {"whole": WHOLE_PRELUDE, "stream": "", "calls": ONE_CALL_PRELUDE}
LOCAL_MODES = ("whole", "calls", "stream")


def prelude(engine: str, mode: str) -> str:
    if mode == "whole" and engine == "local":
        return WHOLE_PRELUDE + "\n" + ONE_CALL_PRELUDE
    return PRELUDES[mode]


@dataclass
class Row:
    engine: str
    tokens: int
    mode: str  # "whole" (before) or "stream" (after); the headline's "calls" too
    ttft: list[float]
    itl: list[float]
    wall_s: float


async def one(http: httpx.AsyncClient, tokens: int, seed: int, row: Row) -> None:
    # No seed: requests of one sampling setting share generation calls (the batcher
    # groups by seed).
    ask = [{"role": "user", "content": f"Count to {seed}."}]
    body = {"model": MODEL, "max_tokens": tokens, "temperature": 1.0, "stream": True,
            "messages": ask}  # fmt: skip
    sent, last = time.perf_counter(), 0.0
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        async for event in sse_events(response):
            choices = event["choices"]
            if not choices or not choices[0]["delta"].get("content"):
                continue
            now = time.perf_counter()
            if last:
                row.itl.append(now - last)
            else:
                row.ttft.append(now - sent)
            last = now


async def measure_engine(engine: str, settings: Settings, note: Note) -> list[Row]:
    rows = []
    async with served(engine) as (endpoint, _):
        async with httpx.AsyncClient(base_url=endpoint.url, timeout=600) as http:
            await one(http, 2, 0, Row(engine, 2, "warm", [], [], 0))
            for tokens in settings.lengths:
                for mode in ("whole", "stream"):
                    note(f"{engine}: {tokens} tokens, {mode}")
                    streaming.WHOLE_REPLY = mode == "whole"
                    policy: Any = endpoint.batcher.policy
                    policy.continuous_batching = mode == "stream" or engine != "local"
                    row = Row(engine, tokens, mode, [], [], 0)
                    limit = anyio.Semaphore(settings.concurrency)
                    start = time.perf_counter()

                    async def request(
                        seed: int, row: Row = row, tokens: int = tokens,
                        limit: anyio.Semaphore = limit,
                    ) -> None:  # fmt: skip
                        async with limit:
                            await one(http, tokens, seed, row)

                    async with anyio.create_task_group() as tasks:
                        for seed in range(settings.requests):
                            tasks.start_soon(request, seed)
                    row.wall_s = time.perf_counter() - start
                    rows.append(row)
    streaming.WHOLE_REPLY = False
    return rows


def ms(values: Sequence[float], q: float) -> float:
    return 1000 * percentile(values, q) if values else 0.0


def table(settings: Settings, rows: list[Row]) -> Table:
    before = {(r.engine, r.tokens): r for r in rows if r.mode == "whole"}
    after = [r for r in rows if r.mode == "stream"]
    body = []
    for r in after:
        b = before[r.engine, r.tokens]
        body.append([r.engine, str(r.tokens), fmt(ms(b.ttft, 50), 1), fmt(ms(r.ttft, 50), 1),
                     fmt(ms(b.ttft, 99), 1), fmt(ms(r.ttft, 99), 1), fmt(ms(b.itl, 50), 2),
                     fmt(ms(r.itl, 50), 2), fmt(ms(b.itl, 99), 2), fmt(ms(r.itl, 99), 2),
                     f"{ms(r.ttft, 50) / max(ms(b.ttft, 50), 1e-9):.2f}",
                     f"{r.wall_s / b.wall_s:.2f}"])  # fmt: skip
    return Table(
        "streaming", "latency", f"Streamed chat replies ({settings.requests} requests, "
        f"concurrency {settings.concurrency}): before (whole reply, then its chunks) and after",
        ["engine", "max tokens", "TTFT p50 ms before", "after", "TTFT p99 before", "after",
         "ITL p50 ms before", "after", "ITL p99 before", "after", "TTFT p50 after/before",
         "wall after/before"],
        body, [(f"{r.engine}, {r.tokens} tokens",
                ms(r.ttft, 50) / max(ms(before[r.engine, r.tokens].ttft, 50), 1e-9))
               for r in after],
        "TTFT p50 of the whole reply then its chunks, same engine, same run",
    )  # fmt: skip


# ----------------------------------------------------------------------------- the headline


@dataclass
class Served:
    """One ``vllm bench serve`` run's figures (its saved result's keys)."""

    engine: str
    tokens: int
    mode: str
    result: dict[str, float]


def built_in_model(where: Path) -> str:
    """The directory of trainers/hf's built-in tiny Llama as a server working in
    ``where`` finds it (its tokenizer is the client's), from a child process: benchmarks
    import no trainers."""
    ask = "from trainers.hf.tiny import built_in; print(built_in().resolve())"
    done = subprocess.run([sys.executable, "-c", ask], cwd=where, capture_output=True,
                          text=True, check=True)  # fmt: skip
    return done.stdout.strip()


def bench_serve(
    url: str, folder: Path, tokenizer: str, tokens: int, settings: Settings, name: str
) -> dict[str, float]:
    """vLLM's client against ``url``: its saved result's figures, and the time to the
    first content (p50, p99)."""
    command = [
        sys.executable, "-m", "benchmarks.vllm_client", "--backend", "openai-chat",
        "--base-url", url, "--endpoint", "/v1/chat/completions", "--model", RECIPE,
        "--tokenizer", tokenizer, "--dataset-name", "random",
        "--random-input-len", str(PROMPT_TOKENS), "--random-output-len", str(tokens),
        "--num-prompts", str(settings.requests), "--max-concurrency",
        str(settings.concurrency), "--ignore-eos", "--disable-tqdm",
        "--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(folder),
        "--result-filename", f"{name}.json",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=CLIENT_S)
    if done.returncode:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stderr[-2000:]}")
    result = json.loads((folder / f"{name}.json").read_text())
    # vLLM's client times its first chunk, the role's (sent at once); the first content
    # comes with the next chunk.
    pairs = zip(result["ttfts"], result["itls"], strict=True)
    firsts = [ttft + (gaps[0] if gaps else 0.0) for ttft, gaps in pairs]
    result["p50_content_ms"] = 1000 * percentile(firsts, 50)
    result["p99_content_ms"] = 1000 * percentile(firsts, 99)
    return {k: v for k, v in result.items() if isinstance(v, int | float)}


def headline(settings: Settings, scratch: Path, note: Note) -> list[Served]:
    """Each engine before and after, each reply length (see the module's docstring).
    The servers share one working directory, so the SFT warm start is trained once."""
    scratch.mkdir(parents=True, exist_ok=True)
    tokenizer = built_in_model(scratch)
    done = []
    for engine in settings.engines:
        for mode in LOCAL_MODES if engine == "local" else ("whole", "stream"):
            folder = scratch / f"{engine}-{mode}"
            folder.mkdir(exist_ok=True)
            overrides = [f"trainer.engine={engine}"]
            with serving(folder, RECIPE, overrides, prelude(engine, mode), cwd=scratch) as server:
                note(f"corun serve {RECIPE} ({engine}, {mode}): {server.url()}")
                for tokens in settings.lengths:
                    result = bench_serve(server.url(), scratch, tokenizer, tokens, settings,
                                         f"{engine}-{mode}-{tokens}")  # fmt: skip
                    if result.get("failed"):
                        raise RuntimeError(f"{result['failed']} requests failed ({engine})")
                    done.append(Served(engine, tokens, mode, result))
    return done


def headline_table(settings: Settings, served_runs: list[Served]) -> Table:
    before = {(r.engine, r.tokens): r.result for r in served_runs if r.mode == "whole"}
    body, ratios = [], []
    for run in (r for r in served_runs if r.mode != "whole"):
        old, new = before[run.engine, run.tokens], run.result
        name = run.engine if run.mode == "stream" else f"{run.engine}, a call at a time"
        body.append([name, str(run.tokens)] + [
            fmt(figures[key], 2) for key in ("p50_ttft_ms", "p50_content_ms", "p99_content_ms",
                                             "p50_itl_ms", "p99_itl_ms", "output_throughput")
            for figures in (old, new)
        ] + [f"{new['p50_content_ms'] / max(old['p50_content_ms'], 1e-9):.2f}"])  # fmt: skip
        ratios.append((f"{name}, {run.tokens} tokens",
                       new["p50_content_ms"] / max(old["p50_content_ms"], 1e-9)))  # fmt: skip
    return Table(
        "streaming", "vllm_bench_serve",
        f"`corun serve {RECIPE}` under `vllm bench serve` ({settings.requests} streamed chat "
        f"requests, {PROMPT_TOKENS} prompt tokens, concurrency {settings.concurrency}, "
        "ignore_eos): before (whole reply, then its chunks) and after",
        ["engine", "reply tokens", "TTFT p50 ms (vLLM's: first chunk) before", "after",
         "first content p50 ms before", "after", "first content p99 before", "after",
         "ITL p50 ms before", "after", "ITL p99 before", "after", "output tok/s before",
         "after", "first content p50 after/before"],
        body, ratios, "first content p50 of the whole reply then its chunks, same engine, same run",
    )  # fmt: skip


async def measure(settings: Settings, note: Note) -> list[Row]:
    rows: list[Row] = []
    for engine in settings.engines:
        rows += await measure_engine(engine, settings, note)
    return rows


def suite(grid: str, scratch: Path, note: Note) -> list[Table]:
    """``corun bench streaming``: TTFT and ITL before and after streaming."""
    settings = GRIDS[grid]
    tables = [table(settings, anyio.run(measure, settings, note))]
    if grid == "full":
        tables.append(headline_table(HEADLINE, headline(HEADLINE, scratch / "serve", note)))
    return tables


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="local only, small")
    parser.add_argument(
        "--headline",
        action="store_true",
        help="only corun serve under vllm bench serve (full grid's)",
    )
    parser.add_argument("--engines", nargs="+", default=list(HEADLINE.engines),
                        help="the headline's engines")  # fmt: skip
    args = parser.parse_args(argv)
    if args.headline:
        settings = replace(HEADLINE, engines=tuple(args.engines))
        with tempfile.TemporaryDirectory() as scratch:
            results = [headline_table(settings, headline(settings, Path(scratch), print))]
    else:
        settings = GRIDS["quick" if args.quick else "full"]
        results = [table(settings, anyio.run(measure, settings, print))]
    for result in results:
        print(" | ".join(result.columns))
        for row in result.rows:
            print(" | ".join(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
