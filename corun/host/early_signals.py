"""Signals before a run has started: quiet exits with 130/143. Free of imports beyond
the standard library, so the ``corun`` command (corun/host/entry.py) installs it before
anything heavy loads."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

_SIGNAL_EXIT = {"SIGINT": 130, "SIGTERM": 143}


def exit_on_signals() -> None:
    """Until a run's own handlers replace these, the first SIGINT/SIGTERM ends the
    process at once, quietly, with 130/143. A signal that is ignored (a background
    job's SIGINT) stays ignored. SIGUSR1, for the whole process's life, prints every
    thread's stack to stderr and changes nothing else (:func:`dump_stacks_on_sigusr1`)."""
    dump_stacks_on_sigusr1()
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _exit_before_run)


def dump_stacks_on_sigusr1() -> None:
    """``kill -USR1 <pid>``: every thread's Python stack on stderr, the process going on
    (the post-mortem of a run that hangs: which collective, which lock)."""
    if not hasattr(signal, "SIGUSR1"):
        return
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (ValueError, OSError, AttributeError):
        # stderr is no file (captured: an embedding host, a test) or this is not the
        # main thread: no dump, nothing else changes.
        pass


def _exit_before_run(signum: int, frame: object) -> None:
    flush_output()
    os._exit(_SIGNAL_EXIT[signal.Signals(signum).name])


def flush_output() -> None:
    """Flush stdout and stderr before an ``os._exit``, whatever state they are in."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # closed, a broken pipe, or a reentrant call from a handler
            pass
