"""``corun serve <recipe>`` in a child process, as a user starts it: its URL from its
first stdout line, its stderr in a log beside, SIGINT and a wait when done. Used by the
suites that drive a served policy from another process (tinker, streaming)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

START_S, STOP_S = 180.0, 60.0  # the server's start (imports, the model) and its stop


class CorunServe:
    """Its run directory is ``folder/run``; ``cwd`` its working directory (built-in
    models and prerequisite runs go there; None: this process's). ``prelude``: Python
    run in the child before the command (a benchmark's baseline knob)."""

    def __init__(
        self, folder: Path, recipe: str, overrides: Sequence[str] = (), prelude: str = "",
        cwd: Path | None = None,
    ) -> None:  # fmt: skip
        self.recipe = recipe
        self.out, self.log = folder / "serve.out", folder / "serve.err"
        entry = f"{prelude}\nfrom corun.host.entry import main\nraise SystemExit(main())"
        run = f"run.dir={folder.resolve() / 'run'}"
        command = [sys.executable, "-c", entry, "serve", recipe, run, *overrides]
        with open(self.out, "wb") as stdout, open(self.log, "wb") as stderr:
            self.proc = subprocess.Popen(command, cwd=cwd, stdin=subprocess.DEVNULL,
                                         stdout=stdout, stderr=stderr)  # fmt: skip
        self.started = time.monotonic()

    def url(self) -> str:
        """Once serving: the URL (a server that ends first, or takes too long, an error
        with its log's end)."""
        while time.monotonic() - self.started < START_S:
            first, newline, _ = self.out.read_text().partition("\n")
            if newline:
                if not first.startswith("corun: serving http://"):
                    break
                return first.removeprefix("corun: serving ").strip()
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        tail = self.log.read_text(errors="replace")[-2000:]
        raise RuntimeError(
            f"corun serve {self.recipe} did not start (exit {self.proc.poll()}):\n{tail}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextmanager
def serving(
    folder: Path, recipe: str, overrides: Sequence[str] = (), prelude: str = "",
    cwd: Path | None = None,
) -> Iterator[CorunServe]:  # fmt: skip
    server = CorunServe(folder, recipe, overrides, prelude, cwd)
    try:
        yield server
    finally:
        server.stop()
