"""The policy endpoint's throughput: completion tokens per second with 1, 8 and 32
agents calling at once, against one agent at a time, measured side by side in this
process (the ``agentic`` trainer's served calculator policy, TinyLM d_model 128,
10-token replies at temperature 1, batching window 2 ms). The ``endpoint`` suite of
``corun bench``, and a program of its own::

    python -m benchmarks.endpoint            # about a minute
    python -m benchmarks.endpoint --quick

Nothing is asserted: timings belong in benchmarks. Measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import anyio
import httpx
import torch

from benchmarks.report import Note, Table, fmt
from corun.base.config import ServeConfig
from corun.contract.config_file import config_from_dict
from corun.contract.policy import Sampling, ServedPolicy
from corun.contract.registry import resolve_trainer
from corun.contract.trainer import SetupContext
from corun.execution.compute import Lane
from corun.serve.server import Endpoint

PROMPT = "123+456="
BODY = {"model": "bench", "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 10, "temperature": 1.0}  # fmt: skip
AGENT = {"kind": "agentic", "d_model": 128, "n_layers": 2, "n_heads": 4, "eval_size": 8}
GRIDS = {"full": 256, "quick": 64, "tiny": 32}  # requests per measurement


async def tokens_per_s(url: str, agents: int, requests: int) -> float:
    """``agents`` clients, each sending ``requests`` chats one after another."""
    tokens = 0
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:

        async def agent() -> None:
            nonlocal tokens
            for _ in range(requests):
                reply = (await http.post("/v1/chat/completions", json=BODY)).json()
                tokens += reply["usage"]["completion_tokens"]

        started = time.perf_counter()
        async with anyio.create_task_group() as pool:
            for _ in range(agents):
                pool.start_soon(agent)
        return tokens / (time.perf_counter() - started)


async def raw_tokens_per_s(policy: ServedPolicy, rows: int, repeats: int = 5) -> float:
    """The same generation without HTTP: ``rows`` prompts in one call."""
    prompts = [policy.encode(PROMPT)] * rows
    sampling = Sampling(10, 1.0, 1.0)
    started, tokens = time.perf_counter(), 0
    for _ in range(repeats):
        done = await policy.generate(prompts, sampling, 0)
        tokens += sum(len(c.ids) for c in done)
    return tokens / (time.perf_counter() - started)


def served_policy(lane: Lane) -> ServedPolicy:
    """The ``agentic`` trainer's policy as the endpoint serves it, freshly initialised
    (through the registry, as ``corun serve`` finds it), generating on ``lane``."""
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="corun-bench-endpoint-") as run_dir:
        config = config_from_dict({"run": {"name": "bench", "dir": run_dir},
                                   "serve": {"enabled": True}, "trainer": AGENT})  # fmt: skip
        trainer = resolve_trainer(config.trainer.kind)(config)
        trainer.setup(SetupContext(config))
    policy = trainer.served_policy(lane)
    assert policy is not None, "the agentic trainer serves its policy"
    return policy


async def measure(
    total: int, wait_ms: float, agent_counts: tuple[int, ...] = (1, 8, 32)
) -> tuple[list[tuple[int, float, int]], list[tuple[int, float]]]:
    """(agents, tokens/s, generation calls) per concurrency, ``total`` requests each, and
    (prompts, tokens/s) of one generate call without HTTP."""
    lane = Lane("serve", torch_threads=2)
    policy = served_policy(lane)
    endpoint = Endpoint(policy, ServeConfig(enabled=True, batch_wait_ms=wait_ms), lane)
    rows = []
    async with endpoint.running() as url:
        await tokens_per_s(url, 8, 4)  # warm up
        for agents in agent_counts:
            before = endpoint.batcher.batches
            rate = await tokens_per_s(url, agents, max(1, total // agents))
            rows.append((agents, rate, endpoint.batcher.batches - before))
        raw = [(n, await raw_tokens_per_s(policy, n)) for n in agent_counts]
    return rows, raw


def suite(grid: str, scratch: Path, note: Note) -> list[Table]:
    """``corun bench endpoint``: tokens/s at 1, 8 and 32 concurrent agents."""
    total = GRIDS[grid]
    note(f"{total} requests at 1, 8, 32 agents")
    rows, raw = anyio.run(measure, total, 2.0)
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


async def main(quick: bool, wait_ms: float) -> None:
    total = GRIDS["quick" if quick else "full"]
    rows, raw = await measure(total, wait_ms)
    print(f"endpoint tokens/s ({os.cpu_count()} CPUs, {total} requests each, batching "
          f"window {wait_ms:g} ms)")  # fmt: skip
    print(f"{'agents':>7} {'tokens/s':>9} {'vs one at a time':>17} {'batches':>8}")
    for agents, rate, batches in rows:
        print(f"{agents:7d} {rate:9.0f} {rate / rows[0][1]:16.1f}x {batches:8d}")
    print("without HTTP, one generate call:", ", ".join(
        f"{n} prompts {rate:.0f} tokens/s" for n, rate in raw
    ))  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--wait-ms", type=float, default=2.0, help="serve.batch_wait_ms")
    args = parser.parse_args()
    anyio.run(main, args.quick, args.wait_ms)
