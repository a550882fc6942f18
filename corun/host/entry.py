"""The ``corun`` command's first and last lines.

First: signals are handled before anything heavy is imported (torch takes seconds), so
a Ctrl-C during imports ends the process quietly with 130 instead of a traceback from
inside some library's import — or a Ctrl-C that the library swallows.

Last: once the command is done (its run torn down, its records closed), the process
leaves without the interpreter's finalization — freeing every module and object torch
and its peers hold took 0.6–1.3 s of a 1.2 s Ctrl-C on 2 cores. Exit handlers
(``atexit``: logging's flush, temporary directories, wandb) still run, and output is
flushed; a non-daemon thread still running gets the interpreter's normal exit, which
waits for it. For the same reason a run's teardown need not hand memory back
(corun/execution/guest.py: ``collections_left_to_exit``).
"""

from __future__ import annotations

import atexit
import os
import threading

from corun.execution import guest
from corun.host.early_signals import exit_on_signals, flush_output


def main() -> int:
    exit_on_signals()
    guest.set_process_ends_with_runs()  # a teardown need not hand memory back: the exit does
    from corun.host.cli import main as cli_main

    return leave(cli_main())


def leave(code: int) -> int:
    """Exit with ``code`` now, after the exit handlers; or return it when a non-daemon
    thread still runs (the interpreter's exit then waits for it, as always)."""
    main_thread = threading.main_thread()
    if any(t is not main_thread and not t.daemon for t in threading.enumerate()):
        return code
    atexit._run_exitfuncs()
    flush_output()
    os._exit(code)
