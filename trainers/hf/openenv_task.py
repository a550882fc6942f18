"""An OpenEnv environment as an hf agentic run's task (``trainer.task = "openenv"``).

The episodes are played through openenv's own client, one WebSocket session each
(corun/agents/openenv.py: the reply's text fills the action's ``action_field``, the
observation's ``observation_field`` is the next user message, the environment's step
rewards add up to the episode's). ``[trainer.environment]`` names the server:

- ``url``: a server that runs already (``openenv``'s Docker image, a Space, your own
  uvicorn), or
- ``app``: the environment's FastAPI app as uvicorn names it (``"module:attr"``, e.g.
  ``"examples.openenv_guess.server.app:app"``, importable from the run's directory),
  which the run serves itself: uvicorn in a child process on a free loopback port
  (:class:`corun.ChildProcess`: it never outlives the run), healthy (``/health``)
  within ``start_timeout_s``, stopped at teardown.

A server that cannot be reached — a ``url`` that does not answer ``/health`` within
``connect_timeout_s``, an ``app`` whose process exits or stays unhealthy — fails the
run at its start with one line naming the URL or the app: a ConfigError (exit 2), as
the environment named is the config's. A running server that fails later fails only
the episodes it fails (``rollout/env_failures``).

The tasks are integers, passed to the environment's ``reset`` as ``task=`` (the
server drops it for an environment whose reset does not take it): batch ``i`` draws
from (run seed, ``i``), one integer in ten (by a stable hash) is held out for the
evaluation. Each episode also gets its own ``seed=`` from (run seed, index, row).
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path
from typing import Annotated

import anyio
import httpx
import msgspec
import sniffio

from corun import SetupContext, stable_seed
from corun.agents.openenv import OpenEnvEnvironment, TextFields, generic_client
from corun.base.errors import ConfigError
from corun.contract.episodes import Episode
from corun.execution.procs import ChildProcess, free_port, last_line
from trainers.agentic.calculator import EnvSettings
from trainers.hf.chat_tasks import ChatTask

INSTALL = "pip install -e '.[openenv]'"
TASKS = 2**31  # the task integers: 0 .. TASKS-1
Seconds = Annotated[float, msgspec.Meta(gt=0)]


class OpenEnvSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[trainer.environment]`` of ``trainer.task = "openenv"``."""

    url: str = ""  # a running server, "http://host:port" ...
    app: str = ""  # ... or the app the run serves, "module:attr"
    action_field: str = "message"  # the action's field the reply's text fills
    observation_field: str = "message"  # the observation's field shown as the user's turn
    # An episode succeeds when it ends with at least this reward (the environment's
    # steps' rewards summed: partial credit on the way need not count as success).
    success_reward: float = 1.0
    start_timeout_s: Seconds = 60.0  # for the served app to answer /health
    connect_timeout_s: Seconds = 10.0  # per connection (a session per episode; the url's check)

    def __post_init__(self) -> None:
        if bool(self.url) == bool(self.app):
            raise ValueError("give exactly one of `url` (a running server) or `app` (to serve)")


def held_out(task: int) -> bool:
    """One task in ten, by a stable hash: never trained on."""
    return stable_seed("openenv-split", task) % 10 == 0


def _draw(rng: random.Random, want_held_out: bool) -> int:
    while True:
        task = rng.randrange(TASKS)
        if held_out(task) == want_held_out:
            return task


class TaskIds:
    """Training batches of task integers: batch ``i`` a pure function of (seed, i)."""

    in_memory = True

    def __init__(self, batch_size: int, seed: int) -> None:
        self.batch_size, self.seed = batch_size, seed

    def batch(self, index: int) -> list[int]:
        rng = random.Random(stable_seed("openenv", self.seed, index))
        return [_draw(rng, want_held_out=False) for _ in range(self.batch_size)]


class OpenEnvTask(ChatTask):
    """Episodes of an OpenEnv environment, through its client, on a served or given URL."""

    Settings = OpenEnvSettings
    settings: OpenEnvSettings

    def __init__(self, settings: OpenEnvSettings, seed: int, system_prompt: str) -> None:
        super().__init__(settings, seed, system_prompt)
        require_openenv()
        self.url = settings.url.rstrip("/")

    async def start(self, ctx: SetupContext) -> None:
        if (loop := sniffio.current_async_library()) != "asyncio":
            raise ConfigError(
                f'`$.trainer.task` = "openenv": openenv\'s client runs on asyncio only, '
                f'this run is on {loop}; set run.backend = "asyncio"'
            )
        if self.settings.app:
            self.url = await serve(self.settings.app, self.settings.start_timeout_s, ctx)
        else:
            await check_reachable(self.url, self.settings.connect_timeout_s)

    def dataset(self, batch_size: int) -> TaskIds:
        return TaskIds(batch_size, self.seed)

    def eval_tasks(self, n: int) -> list[int]:
        rng = random.Random(stable_seed("openenv-eval"))
        return [_draw(rng, want_held_out=True) for _ in range(n)]

    def success(self, episode: Episode) -> bool:
        return episode.status == "done" and episode.reward >= self.settings.success_reward

    def make_env(self, index: int, row: int, settings: EnvSettings) -> OpenEnvEnvironment:
        s = self.settings
        client = generic_client(
            self.url, connect_timeout_s=s.connect_timeout_s,
            message_timeout_s=settings.step_timeout_s,
        )  # fmt: skip
        return OpenEnvEnvironment(
            client, seed=stable_seed("env", self.seed, index, row),
            fields=TextFields(s.action_field, s.observation_field),
            system_prompt=self.system_prompt, connect_timeout_s=s.connect_timeout_s,
        )  # fmt: skip


def require_openenv() -> None:
    try:
        import openenv.core.generic_client  # noqa: F401
    except ImportError:
        raise ConfigError(
            f'`$.trainer.task` = "openenv" needs the openenv-core package: {INSTALL}'
        ) from None


async def check_reachable(url: str, timeout_s: float) -> None:
    """A ConfigError naming ``url`` unless an OpenEnv server answers its /health."""
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            (await client.get(f"{url}/health")).raise_for_status()
    except httpx.HTTPError as exc:
        raise ConfigError(
            f"`$.trainer.environment.url` {url}: no OpenEnv server answers /health "
            f"({type(exc).__name__}: {exc})"
        ) from None


async def serve(app: str, timeout_s: float, ctx: SetupContext) -> str:
    """Serve ``app`` with uvicorn in a child process stopped at teardown; its URL once
    healthy. A ConfigError naming the app if it exits or is not healthy in time."""
    workdir = tempfile.mkdtemp(prefix="corun-openenv-")
    log = Path(workdir) / "server.log"
    port = free_port()
    argv = [app, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    with log.open("wb") as out:
        child = await anyio.to_thread.run_sync(
            lambda: ChildProcess.python_module("uvicorn", argv, workdir, stdout=out, stderr=out)
        )
    ctx.on_teardown("openenv-server", lambda: anyio.to_thread.run_sync(child.stop))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if (status := child.popen.poll()) is not None:
                raise ConfigError(
                    f"`$.trainer.environment.app` {app!r}: the server exited ({status}) "
                    f"before answering: {last_line(log)}"
                )
            try:
                if (await client.get(f"{url}/health")).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            await anyio.sleep(0.1)
    raise ConfigError(
        f"`$.trainer.environment.app` {app!r}: {url}/health did not answer within "
        f"start_timeout_s ({timeout_s:g} s); log: {last_line(log)}"
    )


