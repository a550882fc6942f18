"""``corun train`` with ``run.nproc`` = N > 1: torchrun (``torch.distributed.run``) with N
ranks on this machine, in a child process group, with corun's signal and exit contract.

Two processes sit above the ranks: this launcher (``corun train``) and torchrun's agent
(``python -m corun.launch``: ``torch.distributed.run`` with one-line errors instead of
its tracebacks). The agent starts every rank in a session of its own and sends a
signal it receives to each of them; a rank whose agent dies gets SIGTERM
(``PR_SET_PDEATHSIG``, corun/distributed.py).

Signals to the launcher: the first SIGINT/SIGTERM goes to the agent, which passes it
to every rank: each tears down in the documented order and exits 130/143, then the
agent and the launcher exit with the same status. A second goes to the ranks directly
(they skip optional steps); a third, or ``run.hard_deadline_s`` after the first, kills
every rank and the agent. Otherwise the ranks' exit status is passed through; a rank
killed by a signal is reported in one line and the run exits 1.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import FrameType

from corun.config import Config
from corun.procs import ChildProcess


def launch(config_path: str, overrides: list[str], config: Config) -> int:
    """Run torchrun with ``run.nproc`` ranks of ``corun train`` until it exits."""
    argv = [
        sys.executable, "-m", "corun.launch", "--standalone",
        f"--nproc-per-node={config.run.nproc}", "--monitor-interval=0.1",
        "-m", "corun", "train", config_path, *overrides,
    ]  # fmt: skip
    agent = ChildProcess(argv)
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
    return code


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

    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    try:
        torchrun.run(torchrun.parse_args(argv))  # type: ignore[no-untyped-call]
    except SignalException as exc:  # the ranks got the signal and have exited
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        killed = {rank: f for rank, f in exc.failures.items() if f.exitcode < 0}
        for rank, failure in sorted(killed.items()):
            print(
                f"corun: error: rank {rank} (pid {failure.pid}) was killed by "
                f"{failure.signal_name()}; the other ranks were stopped",
                file=sys.stderr,
            )
        # Otherwise a rank said why itself, and its exit status says how it ended.
        return 1 if killed else exc.get_first_failure()[1].exitcode
    return 0


if __name__ == "__main__":
    sys.exit(main())
