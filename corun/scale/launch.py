"""``corun train`` with ``run.nproc`` = N > 1: torchrun (``torch.distributed.run``) with N
ranks on this machine, in a child process group, with corun's signal and exit contract.

Two processes sit above the ranks: this launcher (``corun train``) and torchrun's agent
(``python -m corun.scale.launch``: ``torch.distributed.run`` with one-line errors instead of
its tracebacks). The agent starts every rank in a session of its own and sends a
signal it receives to each of them; a rank whose agent dies gets SIGTERM
(``PR_SET_PDEATHSIG``, corun/execution/distributed.py).

Signals to the launcher: the first SIGINT/SIGTERM goes to the agent, which passes it
to every rank: each tears down in the documented order and exits 130/143, then the
agent and the launcher exit with the same status. With several nodes (``run.nnodes``)
the ranks of the other nodes follow: a rank's first signal is announced in the
rendezvous store, and every rank stops on it as if signalled
(corun/execution/distributed.py's ``announce_stop``). A second goes to the ranks directly
(they skip optional steps); a third, or ``run.hard_deadline_s`` after the first, kills
every rank and the agent. Otherwise the ranks' exit status is passed through; a rank
killed by a signal is reported in one line and the run exits 1.

After a rank fails (a collective timed out because a peer hangs, say), the agent
SIGTERMs the others and SIGKILLs those still there after ``run.hard_deadline_s`` (the
bound a rank keeps after a signal), at most torchrun's fixed 30 s: a stopped or wedged
rank, which SIGTERM cannot move, ends the run that much after the failure.
"""

from __future__ import annotations

import faulthandler
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
from types import FrameType

from corun.base.config import Config, RunConfig
from corun.execution.procs import ChildProcess


def launch(config_path: str, overrides: list[str], config: Config) -> int:
    """Run torchrun with ``run.nproc`` ranks of ``corun train`` (this node's, of
    ``run.nnodes``) until it exits."""
    argv = [
        sys.executable, "-m", "corun.scale.launch", *_rendezvous(config.run),
        f"--nproc-per-node={config.run.nproc}", "--monitor-interval=0.1",
        f"--shutdown-timeout={math.ceil(config.run.hard_deadline_s)}",
        "-m", "corun", "train", config_path, *overrides,
    ]  # fmt: skip
    # Ranks other than 0 keep their records under this directory (corun/host/cli.py), made
    # here and removed on every exit path: also when a rank was killed and left its own.
    owned = "CORUN_RANK_DIR" not in os.environ
    ranks_dir = os.environ.get("CORUN_RANK_DIR") or tempfile.mkdtemp(prefix="corun-ranks-")
    # torchrun's default for N ranks on one machine, set here so it does not warn about it.
    env = {"OMP_NUM_THREADS": "1", **os.environ, "CORUN_RANK_DIR": ranks_dir}
    agent = ChildProcess(argv, env=env)
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        name = signal.Signals(signum).name
        if len(received) == 1:
            print(f"corun: {name}: stopping every rank; again to skip saving", file=sys.stderr)
            _send([agent.pid], signum)
            timer = threading.Timer(config.run.hard_deadline_s, _kill, (agent, "hard deadline"))
            timer.daemon = True
            timer.start()
        elif len(received) == 2:
            _send(children(agent.pid), signum)
        else:
            _kill(agent, "third signal")

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        code = agent.popen.wait()
    finally:
        agent.stop(grace_s=1.0)
        if owned:
            shutil.rmtree(ranks_dir, ignore_errors=True)
    return code


def _rendezvous(run: RunConfig) -> list[str]:
    """One node: torchrun's own local rendezvous. Several: the static one at node 0's
    ``run.rdzv_endpoint`` (node 0's agent serves its store), each node at its
    ``run.node_rank``, so node 0 holds global rank 0."""
    if run.nnodes == 1:
        return ["--standalone"]
    host, port = run.rdzv_endpoint.rsplit(":", 1)
    return [f"--nnodes={run.nnodes}", f"--node-rank={run.node_rank}",
            f"--master-addr={host}", f"--master-port={port}"]  # fmt: skip


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _send(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _kill(agent: ChildProcess, why: str) -> None:
    print(f"corun: {why}: killing every rank", file=sys.stderr)
    _send(children(agent.pid), signal.SIGKILL)
    _send([agent.pid], signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    """torchrun's agent: ``torch.distributed.run``, its failures as one line each."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # As every corun process (corun/host/early_signals.py): SIGUSR1 prints the stacks.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Its own report of a failure repeats ours, with a binary path; ours is one line.
    # (Each of its modules' loggers has its level set on import: each one, then.)
    for name in [*logging.root.manager.loggerDict, "torch.distributed.elastic"]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    args = torchrun.parse_args(argv)  # type: ignore[no-untyped-call]
    if args.shutdown_timeout is not None:
        _bound_stop(args.shutdown_timeout)
    _stop_once()
    try:
        torchrun.run(args)  # type: ignore[no-untyped-call]
    except SignalException as exc:  # the ranks got the signal and have exited
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        # A rank the agent killed while stopping the others did not fail the run.
        own = {rank: f for rank, f in exc.failures.items() if f.pid not in _stopped}
        killed = {rank: f for rank, f in own.items() if f.exitcode < 0}
        for rank, failure in sorted(killed.items()):
            print(
                f"corun: error: rank {rank} (pid {failure.pid}) was killed by "
                f"{failure.signal_name()}; the other ranks were stopped",
                file=sys.stderr,
            )
        # Otherwise a rank said why itself, and its exit status says how it ended.
        return 1 if killed or not own else min(own.values(), key=lambda f: f.timestamp).exitcode
    return 0


_stopped: set[int] = set()  # pids of ranks the agent stopped after another's failure


def _stop_once() -> None:
    """Make the agent act on its first SIGINT/SIGTERM only. A batch system signals every
    process of a job at once (Slurm's scancel --signal), so the agent gets the stop
    from it and again from this launcher; a second one, raised inside its handling of
    the first, broke its shutdown with a traceback. The launcher escalates (the ranks
    directly, then SIGKILL) on its own."""
    from torch.distributed.elastic.multiprocessing import api

    handler = api._terminate_process_handler
    seen: list[int] = []

    def first_only(signum: int, frame: FrameType | None) -> None:
        if not seen:
            seen.append(signum)
            handler(signum, frame)

    api._terminate_process_handler = first_only


def _bound_stop(grace_s: int) -> None:
    """Make the agent SIGKILL the ranks it stops after a failure ``grace_s`` after its
    SIGTERM: torchrun waits 30 s there (``PContext.close``'s default, which
    ``--shutdown-timeout`` does not reach), and records which ranks it stopped."""
    from torch.distributed.elastic.multiprocessing import api

    close = api.PContext.close

    def bounded(self: api.PContext, death_sig: signal.Signals | None = None,
                timeout: int = grace_s) -> None:  # fmt: skip
        handlers = getattr(self, "subprocess_handlers", {}).values()
        _stopped.update(h.proc.pid for h in handlers if h.proc.poll() is None)
        close(self, death_sig, min(timeout, grace_s))

    api.PContext.close = bounded  # type: ignore[method-assign]


if __name__ == "__main__":
    sys.exit(main())
