"""Streamed replies: time to first token (TTFT) and inter-token latency (ITL) of
streamed chat requests, before (the whole reply generated, then its chunks sent: the
endpoint's old way, kept behind corun/serve/streaming.py's benchmark-only
``WHOLE_REPLY``) and after (each decode step's tokens sent as they are sampled), both in
this run. The tiny Llama as ``hf_grpo`` serves it (benchmarks/endpoint_hf.py's
``served``), on the transformers engine (``local``) and on vLLM in process (``vllm``);
short and long replies. The ``streaming`` suite of ``corun bench``, and::

    python -m benchmarks.streaming            # local and vllm
    python -m benchmarks.streaming --quick    # local only, small

The client is a standard-style streaming client (as ``vllm bench serve``'s
openai-chat backend measures): ``requests`` streamed chat requests, ``concurrency`` at a
time, TTFT from sending to the first content delta, ITL the gaps between content
deltas; p50 and p99. It runs in the endpoint's process (its event loop), so its own
work adds to both sides equally. Nothing is asserted about timings.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx

from benchmarks.endpoint_hf import MODEL, percentile, served
from benchmarks.report import Note, Table, fmt
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


@dataclass
class Row:
    engine: str
    tokens: int
    mode: str  # "whole" (before) or "stream" (after)
    ttft: list[float]
    itl: list[float]
    wall_s: float


async def one(http: httpx.AsyncClient, tokens: int, seed: int, row: Row) -> None:
    # No seed: requests of one sampling setting share generation calls (the batcher
    # groups by seed).
    ask = [{"role": "user", "content": f"Count to {seed}."}]
    body = {"model": MODEL, "max_tokens": tokens, "temperature": 1.0, "stream": True,
            "messages": ask}  # fmt: skip
    sent, last, buffer = time.perf_counter(), 0.0, b""
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        async for data in response.aiter_bytes():  # events end with a blank line (SSE)
            *events, buffer = (buffer + data).split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: {"):
                    continue
                choices = json.loads(event[6:])["choices"]
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


async def measure(settings: Settings, note: Note) -> list[Row]:
    rows: list[Row] = []
    for engine in settings.engines:
        rows += await measure_engine(engine, settings, note)
    return rows


def suite(grid: str, scratch: Path, note: Note) -> list[Table]:
    """``corun bench streaming``: TTFT and ITL before and after streaming."""
    settings = GRIDS[grid]
    return [table(settings, anyio.run(measure, settings, note))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="local only, small")
    args = parser.parse_args(argv)
    settings = GRIDS["quick" if args.quick else "full"]
    result = table(settings, anyio.run(measure, settings, print))
    print(" | ".join(result.columns))
    for row in result.rows:
        print(" | ".join(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
