"""``corun serve <config> serve.tinker=true`` as a child process for tests: the built-in
tiny Llama's directory as the base model, its URL read from the first stdout line, and
a stop (SIGINT) that must exit 130 with nothing left listening."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import tomli_w

from tests.support.processes import REPO, corun_command, environment, wait_until
from trainers.hf.tiny import built_in

API_KEY = "tml-corun-tests"


@dataclass
class TinkerProcess:
    proc: subprocess.Popen[bytes]
    url: str
    model_dir: str  # the base model's directory: what the SDK loads the tokenizer from
    run_dir: Path
    log: Path

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        """SIGINT, and the exit status (the server must end within 60 s)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=60)

    def listening(self) -> bool:
        try:
            httpx.get(f"{self.url}/api/v1/healthz", timeout=5)
        except httpx.ConnectError:
            return False
        return True


@contextmanager
def tinker_server(
    tmp: Path, serve: dict[str, object] | None = None, **trainer: object
) -> Iterator[TinkerProcess]:
    """Serve the Tinker API for the block (``trainer``: the [trainer] table's keys, an
    hf_sft's by default; ``serve``: [serve]'s besides ``tinker``); killed if it
    outlives it."""
    model_dir = str(built_in().resolve())
    config = {
        "run": {"name": "tinker", "dir": str(tmp / "run"), "seed": 0},
        "serve": {"tinker": True, **(serve or {})},
        "trainer": {"kind": "hf_sft", "model": f"hf:{model_dir}", "eval_size": 1, **trainer},
    }
    (tmp / "tinker.toml").write_text(tomli_w.dumps(config))
    out, log = tmp / "serve.out", tmp / "serve.err"
    with open(out, "wb") as stdout, open(log, "wb") as stderr:
        proc = subprocess.Popen(
            [*corun_command(), "serve", str(tmp / "tinker.toml")], cwd=REPO,
            env=environment(), stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
        )  # fmt: skip
    try:
        first = wait_until(lambda: out.read_text().partition("\n")[0], 120,
                           unless=lambda: proc.poll() is not None)  # fmt: skip
        assert first.startswith("corun: serving http://"), (first, log.read_text())
        url = first.removeprefix("corun: serving ").strip()
        yield TinkerProcess(proc, url, model_dir, tmp / "run" / "serve", log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def end_heartbeats(service: object) -> None:
    """End a ``tinker.ServiceClient``'s background loops here, without the server (after
    it stopped, its session's heartbeat would print a failure every 10 s for the rest of
    the process): the SDK's own local close of its session holder."""
    holder = getattr(service, "_session_holder", None)
    if holder is not None:
        holder.close()
