"""A bounded soak: a real ``corun train`` of an async agentic run (``trainer.episodes =
"submitted"``: it trains on what agents play through its OpenAI-compatible endpoint,
rollouts in flight while it trains, a weight sync every few steps, a checkpoint every
``SAVE_EVERY`` steps keeping two), driven by concurrent HTTP agents for N minutes::

    python -m tests.soak --minutes 10 [--agents 32] [--backend asyncio|trio]

The agents (httpx, in teams of a GRPO group each, corun/agents/client.py's calculator
agent) play episodes and report their rewards without pause. Every ``SAMPLE_S`` the
soak reads the run process from /proc — resident memory, open descriptors, threads,
descendants — its event loop's task count (which the run's trainer, ``SoakAgentic``,
records with each step's metrics: no other honest view of a loop from outside), and
the sizes of events.jsonl, metrics.jsonl and trace.json. At the end it stops the run
with SIGINT and checks: no 5xx and no failed connection, exit 130, nothing left
running or listening, no growth of descriptors, threads or tasks, resident memory
flat (its least-squares slope over the second half) and the record files growing by
the step, as documented (docs/testing.md, "Soak"). Exit status 1 with one line per
failed check. tests/test_soak.py runs a short one in CI and a long one.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx
import msgspec
import sniffio
import tomli_w

from corun import Batch, RolloutContext
from corun.records.events import EVENTS_FILE, METRICS_FILE, TRACE_FILE
from tests.support.processes import (
    alive,
    children_of,
    corun_command,
    environment,
    group_alive,
    wait_until,
)
from trainers.agentic.agent import solve
from trainers.agentic.calculator import Problem, Problems
from trainers.agentic.rl import AgenticGRPOTrainer

MODEL = "soak"
GROUP = 4  # episodes per problem (trainer.samples_per_prompt): a team of agents
PROBLEMS_PER_STEP = 4  # data.batch_size: a step trains 16 episodes
SYNC_EVERY = 2  # steps per weight sync
SAVE_EVERY = 50  # steps per checkpoint (two kept)
SAMPLE_S = 2.0
PROGRESS_S = 10.0
FILES = (EVENTS_FILE, METRICS_FILE, TRACE_FILE)

# The bounds of the checks. Descriptors, threads and tasks: the second half's most
# over the first half's most (a connection or a worker thread more at one moment is
# not a leak; one per step or request is); and descriptors at most a connection per
# agent more than before the agents came. Resident memory: least-squares MB/min over
# the second half; measured (docs/testing.md) +0.2 to +0.7 MB/min over 10 minutes, and
# the short CI soak's half-minute window is noisier. Record files: bytes per step, the
# documented figures with a margin (their fields are numbers of varying width).
FD_SLACK, THREAD_SLACK, TASK_SLACK = 4, 2, 16
RSS_SLOPE_MB_PER_MIN = 4.0
BYTES_PER_STEP = {EVENTS_FILE: 1_000, METRICS_FILE: 3_000, TRACE_FILE: 3_000}


# ----------------------------------------------------------------------------- the run


class SoakAgentic(AgenticGRPOTrainer):
    """The agentic GRPO trainer, recording its event loop's task count with each step's
    rollout metrics (``soak/tasks``); otherwise unchanged."""

    async def rollout(self, problems: list[Problem], ctx: RolloutContext) -> Batch:
        batch = await super().rollout(problems, ctx)
        return dataclasses.replace(batch, metrics={**batch.metrics, "soak/tasks": tasks()})


def tasks() -> float:
    """The running event loop's tasks (asyncio), or the task tree's (trio)."""
    if sniffio.current_async_library() == "trio":
        import trio

        root = trio.lowlevel.current_root_task()
        found, nurseries = 0, list(root.child_nurseries if root is not None else ())
        while nurseries:
            children = nurseries.pop().child_tasks
            found += len(children)
            nurseries += [n for task in children for n in task.child_nurseries]
        return float(found + 1)
    import asyncio

    return float(len(asyncio.all_tasks()))


# Rollouts in flight while it trains; no evaluation, a checkpoint now and then.
LOOP = {"concurrency": 2, "sync_interval": SYNC_EVERY, "save_interval": SAVE_EVERY,
        "baseline_eval": False}  # fmt: skip


def config(run_dir: Path, backend: str) -> dict[str, Any]:
    """The soaked run: the tiny calculator policy, rollouts in flight while it trains,
    steps enough to outlast any soak."""
    trainer = {
        "kind": "tests.soak:SoakAgentic", "d_model": 32, "n_heads": 2, "n_layers": 1,
        "samples_per_prompt": GROUP, "eval_size": 16, "lr": 1e-2, "temperature": 1.0,
        "episodes": "submitted", "off_policy_correction": "decoupled",
    }  # fmt: skip
    return {
        "run": {"dir": str(run_dir), "name": MODEL, "steps": 10**7, "backend": backend},
        "loop": LOOP,
        "checkpoint": {"keep": 2},
        "data": {"batch_size": PROBLEMS_PER_STEP},
        "log": {"progress": "off"},
        "serve": {"enabled": True},
        "trainer": trainer,
    }


@dataclass
class Run:
    """The ``corun train`` process (a session of its own) and its run directory."""

    proc: subprocess.Popen[bytes]
    dir: Path

    @classmethod
    def start(cls, tmp: Path, backend: str) -> Run:
        cfg = tmp / "soak.toml"
        cfg.write_text(tomli_w.dumps(config(tmp / "run", backend)))
        with open(tmp / "stdout.txt", "wb") as out, open(tmp / "stderr.txt", "wb") as err:
            proc = subprocess.Popen(
                [*corun_command(), "train", str(cfg)], cwd=tmp, env=environment(),
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
            )  # fmt: skip
        return cls(proc, tmp / "run")

    def stderr(self) -> str:
        path = self.dir.parent / "stderr.txt"
        return path.read_text(errors="replace") if path.exists() else ""

    def url(self, timeout_s: float = 120.0) -> str:
        """The endpoint's URL, once its ``endpoint`` event is written."""
        records = Tail(self.dir / EVENTS_FILE)

        def endpoint() -> str:
            urls = [r["url"] for r in records.read() if r.get("event") == "endpoint"]
            return urls[0] if urls else ""

        exited = lambda: self.proc.poll() is not None  # noqa: E731
        url = wait_until(endpoint, timeout_s, poll_s=0.1, unless=exited)
        if not url:
            raise RuntimeError(f"the run served no endpoint:\n{self.stderr()[-2000:]}")
        return url


class Tail:
    """The complete JSON lines appended to a file since the last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        return [msgspec.json.decode(line) for line in complete.splitlines() if line.strip()]


# ----------------------------------------------------------------------------- samples


@dataclass
class Sample:
    """The run process at one moment (``t``: minutes into the soak)."""

    t: float
    rss_mb: float
    fds: int
    threads: int
    children: int
    step: int
    syncs: int
    tasks: float | None
    sizes: dict[str, int]


class Sampler:
    """Reads the run process and its directory."""

    def __init__(self, run: Run, start: float) -> None:
        self.run, self.start = run, start
        self.events, self.metrics = Tail(run.dir / EVENTS_FILE), Tail(run.dir / METRICS_FILE)
        self.step = self.syncs = 0
        self.tasks: float | None = None
        self.children: set[int] = set()  # every descendant seen

    def sample(self) -> Sample:
        pid = self.run.proc.pid
        status = Path(f"/proc/{pid}/status").read_text()
        rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
        for record in self.events.read():
            self.step = max(self.step, record["step"]) if record["event"] == "step" else self.step
            self.syncs += record["event"] == "sync"
        for record in self.metrics.read():
            self.tasks = record.get("soak/tasks", self.tasks)
        kids = children_of(pid)
        self.children.update(kids)
        sizes = {name: _size(self.run.dir / name) for name in FILES}
        return Sample(
            (time.monotonic() - self.start) / 60, rss / 1024, len(os.listdir(f"/proc/{pid}/fd")),
            len(os.listdir(f"/proc/{pid}/task")), len(kids), self.step, self.syncs, self.tasks,
            sizes,
        )  # fmt: skip


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


# ----------------------------------------------------------------------------- agents


@dataclass
class Traffic:
    """What the agents saw: responses by status, failed connections, episodes."""

    statuses: Counter[int] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    episodes: int = 0
    rewards: float = 0.0

    async def saw(self, response: httpx.Response) -> None:
        self.statuses[response.status_code] += 1

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)


async def team(http: httpx.AsyncClient, traffic: Traffic, index: int, until: float) -> None:
    """Rounds of ``GROUP`` episodes on one problem (a GRPO group), until ``until``."""
    problems = Problems(1, seed=index + 1)
    for round_ in itertools.count():
        if time.monotonic() >= until:
            return
        problem, group = problems.batch(round_)[0], f"team{index}-{round_}"
        async with anyio.create_task_group() as episodes:
            for k in range(GROUP):
                episodes.start_soon(_episode, http, traffic, problem, group, f"{group}-{k}")


async def _episode(
    http: httpx.AsyncClient, traffic: Traffic, problem: Problem, group: str, episode: str
) -> None:
    try:
        _, reward = await solve(http, problem, model=MODEL, episode=episode, group=group,
                                temperature=1.0)  # fmt: skip
    except httpx.HTTPStatusError:  # counted by status
        return
    except httpx.HTTPError as exc:
        traffic.errors.append(f"{episode}: {exc!r}")
        return
    traffic.episodes += 1
    traffic.rewards += reward


# ----------------------------------------------------------------------------- the soak


@dataclass
class Report:
    """A soak's figures and the checks' failures (empty: passed)."""

    minutes: float
    agents: int
    backend: str
    samples: list[Sample]
    traffic: Traffic
    rss_slope_bound: float = RSS_SLOPE_MB_PER_MIN
    exit_code: int | None = None
    leftover: list[int] = field(default_factory=list)
    listening: bool = False
    checkpoints: int = 0

    def failures(self) -> list[str]:
        return check(self)


async def drive(run: Run, url: str, minutes: float, agents: int, report: Report) -> None:
    """The agents for ``minutes`` while sampling; a progress line every ``PROGRESS_S``."""
    start = time.monotonic()
    until = start + minutes * 60
    sampler = Sampler(run, start)
    limits = httpx.Limits(max_connections=agents, max_keepalive_connections=agents)
    hooks = {"response": [report.traffic.saw]}
    client = httpx.AsyncClient(base_url=url, timeout=60, limits=limits, event_hooks=hooks)
    async with client as http:
        async with anyio.create_task_group() as tasks:
            for index in range(agents // GROUP):
                tasks.start_soon(team, http, report.traffic, index, until)
            shown = 0.0
            while time.monotonic() < until and run.proc.poll() is None:
                report.samples.append(sampler.sample())
                if time.monotonic() - shown >= PROGRESS_S:
                    shown = time.monotonic()
                    print(progress(report), flush=True)
                await anyio.sleep(SAMPLE_S)
            # The rounds in flight end (their rewards may wait on training): bounded.
            tasks.cancel_scope.deadline = anyio.current_time() + 120
    if tasks.cancel_scope.cancel_called:
        report.traffic.errors.append("the agents' last rounds did not end within 120 s")
    if run.proc.poll() is None:
        report.samples.append(sampler.sample())
    report.leftover = sorted(sampler.children)


def stop(run: Run, url: str, report: Report) -> None:
    """SIGINT; the exit status; what is left: descendants alive, the port listening."""
    descendants = children_of(run.proc.pid) if run.proc.poll() is None else []
    run.proc.send_signal(signal.SIGINT)
    try:
        report.exit_code = run.proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        report.exit_code = None
    # Its descendants, and its process group (its own session: a daemon that left the
    # tree is still in it).
    gone = wait_until(lambda: not any(alive(p) for p in report.leftover + descendants), 10.0)
    report.leftover = [] if gone else [p for p in report.leftover + descendants if alive(p)]
    if report.exit_code is not None and group_alive(run.proc.pid):
        report.leftover.append(-run.proc.pid)  # (negative: the group)
    report.listening = bool(url) and listening(url)
    report.checkpoints = len(list((run.dir / "checkpoints").glob("step-*")))
    if run.proc.poll() is None or report.leftover:  # leave nothing behind, failed or not
        try:
            os.killpg(run.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in [p for p in report.leftover if p > 0]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        run.proc.wait()


def listening(url: str) -> bool:
    parts = urlsplit(url)
    with socket.socket() as probe:
        probe.settimeout(2)
        return probe.connect_ex((parts.hostname or "", parts.port or 0)) == 0


def soak(
    minutes: float, agents: int = 32, backend: str = "asyncio",
    rss_slope_bound: float = RSS_SLOPE_MB_PER_MIN,
) -> Report:  # fmt: skip
    """Start the run, drive it with ``agents`` agents for ``minutes``, stop it: the report."""
    if agents < GROUP or agents % GROUP:
        raise ValueError(f"agents = {agents}: a positive multiple of {GROUP} (a team each)")
    report = Report(minutes, agents, backend, [], Traffic(), rss_slope_bound)
    with tempfile.TemporaryDirectory(prefix="corun-soak-") as tmp:
        run, url = Run.start(Path(tmp), backend), ""
        try:
            url = run.url()
            print(f"soak: {agents} agents on {url} for {minutes:g} min ({backend})", flush=True)
            anyio.run(drive, run, url, minutes, agents, report, backend=backend)
        finally:
            stop(run, url, report)
    return report


# ----------------------------------------------------------------------------- checks


def halves(samples: list[Sample]) -> tuple[list[Sample], list[Sample]]:
    """The samples before and from the soak's middle."""
    middle = samples[-1].t / 2
    return [s for s in samples if s.t < middle], [s for s in samples if s.t >= middle]


def slope(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of ``points`` (0 for fewer than two)."""
    if len(points) < 2:
        return 0.0
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0


def rss_slope(report: Report) -> float:
    """Resident memory's least-squares slope over the second half, MB/min."""
    return slope([(s.t, s.rss_mb) for s in halves(report.samples)[1]])


def bytes_per_step(report: Report) -> dict[str, float]:
    """Each record file's growth per trained step over the second half."""
    second = halves(report.samples)[1]
    steps = second[-1].step - second[0].step
    if steps <= 0:
        return {}
    return {name: (second[-1].sizes[name] - second[0].sizes[name]) / steps for name in FILES}


def growth(report: Report, what: Callable[[Sample], float | None]) -> float:
    """The second half's most over the first half's most (0 when unknown)."""
    first, second = ([v for s in part if (v := what(s)) is not None]
                     for part in halves(report.samples))  # fmt: skip
    return max(second) - max(first) if first and second else 0.0


def check(report: Report) -> list[str]:
    """The failed checks, one line each."""
    traffic, failures = report.traffic, []
    if traffic.server_errors:
        failures.append(f"{traffic.server_errors} responses were 5xx ({dict(traffic.statuses)})")
    if traffic.errors:
        failures.append(f"{len(traffic.errors)} requests failed: {traffic.errors[0]}")
    if report.exit_code != 130:
        failures.append(f"the run exited {report.exit_code} on SIGINT, not 130")
    if report.leftover or report.listening:
        failures.append(f"left behind: processes {report.leftover}, listening {report.listening}")
    if report.checkpoints > 2:
        failures.append(f"{report.checkpoints} checkpoints kept, not 2 (checkpoint.keep)")
    if len(report.samples) < 4 or not traffic.requests:
        return [*failures, f"too little to judge: {len(report.samples)} samples, no requests"]
    connections = max(s.fds for s in report.samples) - report.samples[0].fds
    if connections > report.agents + FD_SLACK:
        failures.append(f"{connections} descriptors more than before the agents came, for "
                        f"{report.agents} agents (a connection each)")  # fmt: skip
    for name, what, slack in (("descriptors", lambda s: s.fds, FD_SLACK),
                              ("threads", lambda s: s.threads, THREAD_SLACK),
                              ("tasks", lambda s: s.tasks, TASK_SLACK)):  # fmt: skip
        if growth(report, what) > slack:
            failures.append(f"{name} grew by {growth(report, what):g} (bound {slack})")
    if rss_slope(report) > report.rss_slope_bound:
        failures.append(f"resident memory grew {rss_slope(report):.2f} MB/min over the second "
                        f"half (bound {report.rss_slope_bound:g})")  # fmt: skip
    grown = bytes_per_step(report)
    if not grown:
        failures.append("no step was trained in the second half")
    for name, rate in grown.items():
        if rate > BYTES_PER_STEP[name]:
            failures.append(f"{name} grew {rate:.0f} bytes/step (bound {BYTES_PER_STEP[name]})")
    return failures


# ----------------------------------------------------------------------------- output


def progress(report: Report) -> str:
    s, traffic = report.samples[-1], report.traffic
    tasks = "-" if s.tasks is None else f"{s.tasks:g}"
    return (f"{s.t:5.1f} min  step {s.step}  syncs {s.syncs}  requests {traffic.requests}  "
            f"5xx {traffic.server_errors}  episodes {traffic.episodes}  rss {s.rss_mb:.0f} MB  "
            f"fds {s.fds}  threads {s.threads}  tasks {tasks}")  # fmt: skip


def table(report: Report) -> str:
    """The final table: the samples' first, most and last, traffic, growth, checks."""
    samples, traffic = report.samples, report.traffic
    lines = [f"{'':<12}{'first':>10}{'max':>10}{'last':>10}"]
    for name, what in (("rss MB", lambda s: s.rss_mb), ("fds", lambda s: s.fds),
                       ("threads", lambda s: s.threads), ("tasks", lambda s: s.tasks),
                       ("children", lambda s: s.children)):  # fmt: skip
        values = [v for s in samples if (v := what(s)) is not None]
        if values:
            lines.append(f"{name:<12}{values[0]:>10.0f}{max(values):>10.0f}{values[-1]:>10.0f}")
    last = samples[-1] if samples else Sample(0, 0, 0, 0, 0, 0, 0, None, dict.fromkeys(FILES, 0))
    reward = traffic.rewards / traffic.episodes if traffic.episodes else 0.0
    lines += [
        f"requests {traffic.requests} {dict(sorted(traffic.statuses.items()))}, 5xx "
        f"{traffic.server_errors}, failed {len(traffic.errors)}; episodes {traffic.episodes} "
        f"(mean reward {reward:.2f})",
        f"steps {last.step}, syncs {last.syncs} in {last.t:.1f} min; checkpoints kept "
        f"{report.checkpoints}",
        f"rss slope over the second half {rss_slope(report):+.2f} MB/min "
        f"(bound {report.rss_slope_bound:g})",
    ]
    for name, rate in bytes_per_step(report).items():
        lines.append(f"{name:<14}{last.sizes[name]:>10} bytes, {rate:6.0f} bytes/step "
                     f"(bound {BYTES_PER_STEP[name]})")  # fmt: skip
    lines.append(f"exit {report.exit_code}; left running {report.leftover}; "
                 f"listening {report.listening}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    summary = (__doc__ or "").split("\n\n")[0]
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=summary)
    parser.add_argument("--minutes", type=float, required=True, help="how long the agents play")
    parser.add_argument("--agents", type=int, default=32, help=f"teams of {GROUP}")
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        parser.error(f"--minutes {args.minutes:g}: more than 0")
    if args.agents < GROUP or args.agents % GROUP:
        parser.error(f"--agents {args.agents}: a positive multiple of {GROUP} (a team each)")
    try:
        report = soak(args.minutes, args.agents, args.backend)
    except RuntimeError as exc:
        print(f"soak: {exc}", file=sys.stderr, flush=True)
        return 1
    print(table(report), flush=True)
    failures = report.failures()
    if failures:
        print(f"soak: failed: {'; '.join(failures)}", file=sys.stderr, flush=True)
        return 1
    print("soak: passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
