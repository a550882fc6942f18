"""The policy endpoint serving a Hugging Face model: the built-in tiny Llama as the
``hf_grpo`` trainer serves it (through the registry: ``served_policy`` is an
``EnginePolicy`` over the trainer's rollout engine), on the transformers engine
(``local``) and on vLLM in process (``vllm``). The ``endpoint_hf`` suite of ``corun
bench``, and a program of its own::

    python -m benchmarks.endpoint_hf                     # local and vllm, ~4 min on 2 CPUs
    python -m benchmarks.endpoint_hf --engines vllm      # one engine
    python -m benchmarks.endpoint_hf --quick --json out.json  # local only, ~25 s (the test's)

1. **Load**: 1, 8 and 32 agents at once, each holding multi-turn chat conversations
   (``TURNS`` turns: a user question, the reply sent back with a follow-up, ...;
   ``MAX_TOKENS`` new tokens a reply at temperature 1), without and with capture (each
   conversation an episode on its own base URL ``/episodes/<id>/v1``, its reward posted
   at the end). Completion tokens/s over the wall time, p50/p99 latency of the chat
   requests, and requests per generation call (the batcher's). Ratios: to 1 agent (same
   engine, same capture), to no capture (same engine, same agents) and to ``local``,
   measured side by side in this run.
2. **Weight-sync pause**: ``Settings.sync_agents`` agents keep sending one-turn chats
   while the trainer syncs its weights to the engine now and then
   (``trainer.sync_weights``, as a run does: ``engine.update_weights`` with the
   trainer's weights, perturbed a little before each sync so every version differs,
   versions increasing, then the engine's fingerprint checked). A request whose time in
   flight overlapped a sync's is "overlapping"; its extra latency is its latency over
   the p50 of the requests that overlapped none ("clear"; their own p99 and max over it
   are the noise floor). Syncs are spaced 3-5 p50 latencies apart (seeded), so both
   kinds of request are plentiful.

The agents run in a process of their own (:class:`Agents`), as real agents do: in the
endpoint's process their HTTP clients would share its event loop and GIL with the
engine's thread. Nothing is asserted about timings: they belong here. The tiny model's
weights are random, so replies run to ``MAX_TOKENS`` almost always (the token counts
are what the endpoint reported). SIGINT or SIGTERM cancels the run and shuts the
engines down.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import torch
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from benchmarks.quiet import OtherLoad
from benchmarks.report import Note, Table, fmt, markdown_table
from benchmarks.setup import set_up
from corun.base.config import ServeConfig
from corun.contract.config_file import config_from_dict
from corun.execution.compute import Lane
from corun.serve.server import Endpoint

ENGINES = ("local", "vllm", "vllm-server")  # the choices; the default is the first two
BASELINE = "local"
TRAINER = {"kind": "hf_grpo", "model": "tiny-llama"}  # the built-in tiny Llama
MODEL = "bench"  # the run's name: the served model's
MAX_TOKENS = 16  # new tokens per reply
TURNS = 4  # chat requests per conversation (~135 of the tiny model's 256 positions)
FOLLOW_UP = "And what is that plus 1?"
PERTURB = 1e-4  # the noise added to every weight before a sync (std)


@dataclass(frozen=True)
class Settings:
    name: str
    engines: tuple[str, ...]
    agents: tuple[int, ...]  # concurrent agents of the load measurement
    requests: int  # chat requests per (engine, agents, capture) and round
    rounds: int  # of the load measurement
    sync_agents: int  # agents requesting during the syncs
    syncs: int  # weight syncs per engine


GRIDS = {
    "full": Settings("full", ("local", "vllm"), (1, 8, 32), 256, 2, 8, 24),
    "quick": Settings("quick", ("local",), (1, 8, 32), 32, 1, 8, 4),
    "tiny": Settings("tiny", ("local",), (1, 8, 32), 32, 1, 4, 3),
}


@dataclass
class LoadRow:
    engine: str
    agents: int
    capture: bool
    requests: int
    seconds: float
    tokens_per_s: float
    p50_ms: float
    p99_ms: float
    rounds: list[float]  # tokens/s of each round
    calls: int  # generation calls for the requests (all rounds)
    vs_one_agent: float = 0.0  # tokens/s over 1 agent's (same engine, same capture)
    vs_no_capture: float = 0.0  # tokens/s over no capture's (same engine, same agents)


@dataclass
class SyncRow:
    engine: str
    syncs: int
    sync_ms_p50: float  # a sync's own time (drain, reload, fingerprint check)
    sync_ms_max: float
    overlapping: int  # requests in flight during a sync
    clear: int  # requests that overlapped none
    clear_p50_ms: float  # their latency
    clear_extra_p99_ms: float  # their p99 and max over their p50: the noise floor
    clear_extra_max_ms: float
    extra_p50_ms: float  # overlapping requests' latency over clear_p50_ms
    extra_max_ms: float


def progress(message: str) -> None:
    print(f"[endpoint_hf] {message}", file=sys.stderr, flush=True)


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 of nothing)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


# ----------------------------------------------------------------------------- serving


@asynccontextmanager
async def served(engine: str) -> AsyncIterator[tuple[Endpoint, Any]]:
    """The endpoint of the ``hf_grpo`` trainer's policy on ``engine`` (the trainer set
    up through the registry on a train lane, as a run does) and the trainer; all of it
    torn down on the way out."""
    async with AsyncExitStack() as stack:
        run_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="corun-endpoint-hf-"))
        config = config_from_dict({"run": {"name": MODEL, "dir": run_dir},
                                   "trainer": {**TRAINER, "engine": engine}})  # fmt: skip
        trainer = await set_up(config, stack, train_lane=True)
        serve_lane = Lane("serve")  # the endpoint's own (closed when it stops)
        endpoint = Endpoint(
            trainer.served_policy(serve_lane), ServeConfig(enabled=True), serve_lane
        )
        async with endpoint.running():
            yield endpoint, trainer


# ----------------------------------------------------------------------------- the agents


def question(rng: random.Random) -> dict[str, Any]:
    return {"role": "user", "content": f"What is {rng.randrange(100)} plus {rng.randrange(100)}?"}


class Agent:
    """One client's chat requests: their latencies (s), times and completion tokens."""

    def __init__(self, http: httpx.AsyncClient, seed: int) -> None:
        self.http = http
        self.rng = random.Random(seed)
        self.latencies: list[float] = []
        self.spans: list[tuple[float, float]] = []  # (sent, answered), time.monotonic
        self.tokens = 0

    async def chat(self, base: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS,
                "temperature": 1.0}  # fmt: skip
        sent = time.monotonic()
        response = await self.http.post(f"{base}/chat/completions", json=body)
        answered = time.monotonic()
        if response.status_code != 200:
            raise RuntimeError(f"chat: {response.status_code} {response.text[:300]}")
        reply: dict[str, Any] = response.json()
        self.latencies.append(answered - sent)
        self.spans.append((sent, answered))
        self.tokens += reply["usage"]["completion_tokens"]
        return reply

    async def converse(self, turns: int, capture: bool) -> None:
        """One conversation of ``turns`` chat requests; captured: an episode on its own
        base URL, its reward posted at the end (and its recorded turns checked)."""
        episode = uuid.uuid4().hex
        base = f"/episodes/{episode}/v1" if capture else "/v1"
        messages = [question(self.rng)]
        for _ in range(turns):
            reply = await self.chat(base, messages)
            messages += [reply["choices"][0]["message"], {"role": "user", "content": FOLLOW_UP}]
        if capture:
            response = await self.http.post(f"/v1/episodes/{episode}/reward", json={"reward": 1})
            recorded = response.json().get("turns") if response.status_code == 200 else None
            if recorded != turns:
                raise RuntimeError(f"episode {episode}: {response.status_code} {response.text}")

    async def conversations(self, requests: int, capture: bool) -> None:
        while requests > 0:
            await self.converse(min(TURNS, requests), capture)
            requests -= TURNS


async def agents_main(url: str) -> None:
    """The agents' process: a command a line on stdin, its result a JSON line on stdout.
    ``{"load": [agents, requests, capture]}``: the figures of that many agents at once;
    ``{"keep": agents}``: one-turn chats until a ``stop`` line, ``{"p50_s": ...}`` once
    every agent has its first replies, then the requests' (sent, answered) times."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while line := await anyio.to_thread.run_sync(sys.stdin.readline):
            command = json.loads(line)
            if "load" in command:
                result = await load(http, *command["load"])
            else:
                result = await keep_requesting(http, command["keep"])
            print(json.dumps(result), flush=True)


async def load(http: httpx.AsyncClient, agents: int, requests: int, capture: bool) -> Any:
    pool = [Agent(http, seed=1000 * agents + i) for i in range(agents)]
    started = time.monotonic()
    async with anyio.create_task_group() as tasks:
        for agent in pool:
            tasks.start_soon(agent.conversations, max(1, requests // agents), capture)
    seconds = time.monotonic() - started
    latencies = [s * 1e3 for agent in pool for s in agent.latencies]
    return {"tokens": sum(a.tokens for a in pool), "seconds": seconds, "latencies_ms": latencies}


async def keep_requesting(http: httpx.AsyncClient, agents: int) -> Any:
    pool = [Agent(http, seed=7_000 + i) for i in range(agents)]
    warm, stop = anyio.Event(), anyio.Event()

    async def requesting(agent: Agent) -> None:
        while not stop.is_set():
            await agent.chat("/v1", [question(agent.rng)])
            if not warm.is_set() and all(len(a.latencies) >= 3 for a in pool):
                warm.set()

    async with anyio.create_task_group() as tasks:
        for agent in pool:
            tasks.start_soon(requesting, agent)
        await warm.wait()
        print(json.dumps({"p50_s": statistics.median(s for a in pool for s in a.latencies)}),
              flush=True)  # fmt: skip
        await anyio.to_thread.run_sync(sys.stdin.readline)  # "stop"
        stop.set()
    return [span for agent in pool for span in agent.spans]


class Agents:
    """The parent's end of the agents' process (``python -m benchmarks.endpoint_hf
    --agents URL``). Their own process, as real agents are: in the endpoint's, their
    clients share its event loop and GIL with the engine's generating thread, and their
    requests trickle in (measured: 32 agents on the local engine got 2-4 requests a
    generation call, 420 tokens/s; from a process of their own 11-27, 2,200 tokens/s)."""

    def __init__(self, process: Process) -> None:
        self.process = process
        assert process.stdin is not None and process.stdout is not None
        self.stdin = process.stdin
        self.stdout = BufferedByteReceiveStream(process.stdout)

    @classmethod
    @asynccontextmanager
    async def start(cls, url: str) -> AsyncIterator[Agents]:
        command = [sys.executable, "-m", "benchmarks.endpoint_hf", "--agents", url]
        async with await anyio.open_process(command, stderr=None) as process:
            agents = cls(process)
            try:
                yield agents
            finally:
                await agents.stdin.aclose()  # the agents' cue to exit
                with anyio.move_on_after(5, shield=True):  # mid-command: killed
                    await process.wait()
                if process.returncode is None:
                    process.kill()

    async def send(self, command: Any) -> None:
        await self.stdin.send(json.dumps(command).encode() + b"\n")

    async def receive(self) -> Any:
        try:
            return json.loads(await self.stdout.receive_until(b"\n", 1 << 28))
        except (anyio.EndOfStream, anyio.IncompleteRead):
            raise RuntimeError("the agents' process ended (its error is above)") from None


# ----------------------------------------------------------------------------- load


@dataclass
class Sample:
    tokens: int
    seconds: float
    latencies_ms: list[float]
    calls: int  # generation calls the endpoint's batcher made


async def measure_load(
    endpoint: Endpoint, agents: Agents, engine: str, settings: Settings
) -> list[LoadRow]:
    """Each agent count without and with capture, back to back, in ``settings.rounds``
    rounds (the orders alternating), after a warm-up of both paths; a row pools its
    rounds: their tokens over their seconds, their latencies."""

    async def sample(count: int, requests: int, capture: bool) -> Sample:
        calls = endpoint.batcher.batches
        await agents.send({"load": [count, requests, capture]})
        got = await agents.receive()
        return Sample(**got, calls=endpoint.batcher.batches - calls)

    await sample(8, 16, False)
    await sample(8, 16, True)
    cells: dict[tuple[int, bool], list[Sample]] = {}
    for round_ in range(settings.rounds):
        counts = settings.agents if round_ % 2 == 0 else settings.agents[::-1]
        for index, count in enumerate(counts):
            for capture in (False, True) if (index + round_) % 2 == 0 else (True, False):
                got = await sample(count, settings.requests, capture)
                cells.setdefault((count, capture), []).append(got)
                progress(f"{engine} {count:>2} agents {'capture' if capture else 'plain':<7} "
                         f"round {round_ + 1}: {got.tokens / got.seconds:7.0f} tokens/s, p50 "
                         f"{percentile(got.latencies_ms, 50):6.1f} ms")  # fmt: skip
    order = sorted(cells, key=lambda cell: (cell[1], cell[0]))  # plain first, by agents
    rows = [load_row(engine, count, capture, cells[count, capture]) for count, capture in order]
    for row in rows:
        one = next(r for r in rows if r.agents == settings.agents[0] and r.capture == row.capture)
        plain = next(r for r in rows if r.agents == row.agents and not r.capture)
        row.vs_one_agent = round(row.tokens_per_s / one.tokens_per_s, 3)
        row.vs_no_capture = round(row.tokens_per_s / plain.tokens_per_s, 3)
    return rows


def load_row(engine: str, agents: int, capture: bool, samples: list[Sample]) -> LoadRow:
    seconds = sum(s.seconds for s in samples)
    latencies = [ms for s in samples for ms in s.latencies_ms]
    return LoadRow(
        engine, agents, capture, len(latencies), round(seconds, 3),
        round(sum(s.tokens for s in samples) / seconds, 1), round(percentile(latencies, 50), 2),
        round(percentile(latencies, 99), 2), [round(s.tokens / s.seconds, 1) for s in samples],
        sum(s.calls for s in samples),
    )  # fmt: skip


# ----------------------------------------------------------------------------- syncs


async def measure_syncs(agents: Agents, engine: str, trainer: Any, settings: Settings) -> SyncRow:
    """The agents requesting while the trainer syncs (see the module's docstring)."""
    await agents.send({"keep": settings.sync_agents})
    typical = (await agents.receive())["p50_s"]
    rng, noise = random.Random(0), torch.Generator().manual_seed(0)
    syncs: list[tuple[float, float]] = []
    for version in range(1, settings.syncs + 1):
        await anyio.sleep(rng.uniform(3, 5) * max(typical, 0.01))
        with torch.no_grad():  # the trainer's own copy: the engine holds another
            for weight in trainer.policy.model.parameters():
                weight.add_(torch.randn(weight.shape, generator=noise) * PERTURB)
        started = time.monotonic()
        await trainer.sync_weights(version)  # verified: update_weights, then fingerprints
        syncs.append((started, time.monotonic()))
    await anyio.sleep(rng.uniform(3, 5) * max(typical, 0.01))
    await agents.send("stop")
    return pause_row(engine, await agents.receive(), syncs)


def pause_row(
    engine: str, spans: list[tuple[float, float]], syncs: list[tuple[float, float]]
) -> SyncRow:
    def overlaps(sent: float, answered: float) -> bool:
        return any(sent < end and start < answered for start, end in syncs)

    hit = [(answered - sent) * 1e3 for sent, answered in spans if overlaps(sent, answered)]
    clear = [(answered - sent) * 1e3 for sent, answered in spans if not overlaps(sent, answered)]
    base = percentile(clear, 50)

    def extra(values: list[float], q: float) -> float:  # q = 100: the max
        return round(percentile(values, q) - base, 2) if values else 0.0

    took = [(end - start) * 1e3 for start, end in syncs]
    return SyncRow(
        engine, len(syncs), round(percentile(took, 50), 2), round(max(took, default=0), 2),
        len(hit), len(clear), round(base, 2), extra(clear, 99), extra(clear, 100),
        extra(hit, 50), extra(hit, 100),
    )  # fmt: skip


# ----------------------------------------------------------------------------- a run


async def measure(settings: Settings) -> tuple[list[LoadRow], list[SyncRow]]:
    """Every engine of ``settings`` in turn (the server first, while the environment is
    the user's: in-process vLLM sets ``VLLM_*``); KeyboardInterrupt after SIGINT or
    SIGTERM cancelled it (an anyio cancellation: see benchmarks/engines.py)."""
    loads: list[LoadRow] = []
    pauses: list[SyncRow] = []
    done = False
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(_cancel_on_signal, tasks.cancel_scope)
        for engine in sorted(settings.engines, key=lambda e: e != "vllm-server"):
            progress(f"starting {engine}")
            started = time.perf_counter()
            async with served(engine) as (endpoint, trainer), Agents.start(endpoint.url) as agents:
                progress(f"{engine} serving in {time.perf_counter() - started:.1f} s")
                loads += await measure_load(endpoint, agents, engine, settings)
                pauses.append(await measure_syncs(agents, engine, trainer, settings))
                progress(f"{engine} syncs: {pauses[-1]}")
        done = True
        tasks.cancel_scope.cancel()
    if not done:
        raise KeyboardInterrupt
    order = {e: i for i, e in enumerate(ENGINES)}
    loads.sort(key=lambda r: (order[r.engine], r.capture, r.agents))
    return loads, sorted(pauses, key=lambda r: order[r.engine])


async def _cancel_on_signal(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:  # once: a second signal finds Python's handlers back
            progress(f"{signal.Signals(signum).name}: shutting everything down")
            scope.cancel()


# ----------------------------------------------------------------------------- the tables


def tables(settings: Settings, loads: list[LoadRow], pauses: list[SyncRow]) -> list[Table]:
    one = settings.agents[0]
    local = {(r.agents, r.capture): r.tokens_per_s for r in loads if r.engine == BASELINE}
    load_table = Table(
        "endpoint_hf", "load", f"HF endpoint under load ({settings.rounds} x "
        f"{settings.requests} chat requests each, {TURNS}-turn conversations, "
        f"{MAX_TOKENS} tokens a reply)",
        ["engine", "capture", "agents", "tokens/s", f"vs {one} agent", "vs no capture",
         f"vs {BASELINE}", "p50 ms", "p99 ms", "requests a call"],
        [[r.engine, "yes" if r.capture else "no", str(r.agents), fmt(r.tokens_per_s, 0),
          f"{r.vs_one_agent:.2f}", f"{r.vs_no_capture:.2f}",
          f"{r.tokens_per_s / local[r.agents, r.capture]:.2f}"
          if (r.agents, r.capture) in local else "-", fmt(r.p50_ms, 1), fmt(r.p99_ms, 1),
          fmt(r.requests / max(1, r.calls), 1)]
         for r in loads],
        [(f"{r.engine}, {r.agents} agents{', capture' if r.capture else ''}", r.vs_one_agent)
         for r in loads],
        f"{one} agent, same engine and capture, same run",
    )  # fmt: skip
    sync_table = Table(
        "endpoint_hf", "sync", f"Requests during weight syncs ({settings.sync_agents} agents, "
        f"{MAX_TOKENS} tokens a reply)",
        ["engine", "syncs", "sync ms p50 / max", "requests overlapping / clear",
         "clear: latency p50 ms", "clear: extra ms p99 / max",
         "overlapping: extra ms p50 / max"],
        [[p.engine, str(p.syncs), f"{fmt(p.sync_ms_p50, 1)} / {fmt(p.sync_ms_max, 1)}",
          f"{p.overlapping} / {p.clear}", fmt(p.clear_p50_ms, 1),
          f"{fmt(p.clear_extra_p99_ms, 1)} / {fmt(p.clear_extra_max_ms, 1)}",
          f"{fmt(p.extra_p50_ms, 1)} / {fmt(p.extra_max_ms, 1)}"]
         for p in pauses],
        [(p.engine, (p.clear_p50_ms + p.extra_p50_ms) / p.clear_p50_ms) for p in pauses
         if p.clear_p50_ms > 0],
        "the p50 latency of the requests that overlapped no sync, same engine, same run "
        "(each bar: the overlapping requests' p50)",
    )  # fmt: skip
    return [load_table, sync_table]


def suite(grid: str, scratch: Path, note: Note) -> list[Table]:
    """``corun bench endpoint_hf``: load and weight-sync pauses (the quick grids: the
    local engine only; vLLM's start alone takes 15-30 s on 2 CPUs)."""
    settings = GRIDS[grid]
    note(f"engines {', '.join(settings.engines)}, agents {settings.agents}")
    loads, pauses = anyio.run(measure, settings)
    return tables(settings, loads, pauses)


def parse_engines(text: str) -> tuple[str, ...]:
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    if not chosen or set(chosen) - set(ENGINES):
        raise argparse.ArgumentTypeError(f"choose from {', '.join(ENGINES)} (got {text!r})")
    return tuple(e for e in ENGINES if e in chosen)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: local, small")
    parser.add_argument("--engines", type=parse_engines, help="a subset of "
                        f"{','.join(ENGINES)} (default: the grid's)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument("--agents", metavar="URL", help=argparse.SUPPRESS)  # their process
    args = parser.parse_args(argv)
    if args.agents:  # the agents' process: the parent ends it (a Ctrl-C is the parent's)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        anyio.run(agents_main, args.agents)
        return 0
    settings = GRIDS["quick" if args.quick else "full"]
    if args.engines:
        settings = replace(settings, engines=args.engines)
    others, started = OtherLoad(), time.monotonic()
    try:
        loads, pauses = anyio.run(measure, settings)
    except KeyboardInterrupt:
        return 130
    busy, elapsed = others.stop(), time.monotonic() - started
    load = "unknown" if busy is None else f"{busy:.2f}"
    print(f"the policy endpoint on the built-in tiny Llama ({settings.name}; "
          f"{os.cpu_count()} CPUs; other processes kept {load} CPUs busy on average; "
          f"load average now {os.getloadavg()[0]:.2f})\n")  # fmt: skip
    for table in tables(settings, loads, pauses):
        print("\n".join(markdown_table(table, plot=False)))
    print(f"({elapsed:.0f} s)")
    if args.json:
        figures = {
            "settings": asdict(settings), "others_cpus": busy, "elapsed_s": elapsed,
            "load": [asdict(r) for r in loads], "sync": [asdict(p) for p in pauses],
        }  # fmt: skip
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
