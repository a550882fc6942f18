"""The Ray cluster a run's rollout workers live on: one the user already runs
(``rollout.address``), or a local one corun starts for the run and stops after it.

A local cluster is ``ray start --head --block`` as a :class:`corun.ChildProcess`: its
own session and process group, so teardown (and the CLI's hard-exit path) kills
everything Ray started for the run — GCS, raylet, agents, and the worker processes,
which Ray moves into process groups of their own but which stay in the session.
(A plain ``ray.init()`` cluster belongs to the driver: after a SIGKILL of the driver
its agents and blocked workers were measured alive.) A SIGKILL of corun itself is
covered too: ``ray start`` runs under the parent watch of
:meth:`corun.ChildProcess.python_module`, which kills the session and removes the
temp dir once corun is gone.

Hermetic: its own temp dir (``--temp-dir``, under ``$RAY_TMPDIR`` or the system's),
free ports chosen here, and token auth with a token made for the run, handed to
the cluster and to this driver through the environment (``RAY_AUTH_TOKEN``) — never
``$HOME/.ray/auth_token``.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from corun.base.config import RolloutConfig
from corun.base.errors import ConfigError
from corun.contract.engine import EngineError
from corun.execution.procs import ChildProcess, free_port

# Fixed by default in `ray start`; two clusters on one machine must not share them.
_PORT_FLAGS = (
    "--ray-client-server-port", "--dashboard-port", "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port",
)  # fmt: skip


class RayClusterError(EngineError):
    """The Ray cluster could not be started or reached."""


class LocalCluster:
    """``ray start --head --block`` in a process group this run owns; or, with
    ``join``, another node of that cluster on this machine (``ray start --address``:
    how tests stand up a cluster of several nodes on loopback). ``resources``: the
    node's custom resources (``rollout.resources`` places actors by them)."""

    def __init__(
        self, num_cpus: int, timeout_s: float, *, resources: dict[str, float] | None = None,
        join: LocalCluster | None = None,
    ) -> None:  # fmt: skip
        base = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
        # Short: Ray's unix socket paths live under it (107-byte limit).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="corun-ray-", dir=base))
        # One token for the whole cluster: a joining node uses its head's.
        self.auth: dict[str, str] = join.auth if join else {
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}  # fmt: skip
        self.saved_env: dict[str, str | None] | None = None  # while this driver uses auth
        env = {
            **os.environ, **self.auth, "RAY_USAGE_STATS_ENABLED": "0",
            # The workers import the trainer the way this process does.
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and Path(p).is_dir()),
        }  # fmt: skip
        flags = _PORT_FLAGS if join is None else _PORT_FLAGS[2:]  # the first two: the head's
        ports = [f"{flag}={free_port()}" for flag in flags]
        where = (["--head", "--port=0", "--include-dashboard=false"] if join is None
                 else [f"--address={join.address}"])  # fmt: skip
        args = [
            "start", *where, "--block", f"--num-cpus={num_cpus}",
            f"--temp-dir={self.temp_dir}", "--node-ip-address=127.0.0.1",
            "--disable-usage-stats", *ports,
            *([f"--resources={json.dumps(resources)}"] if resources else []),
        ]  # fmt: skip
        log = open(self.temp_dir / "ray-start.log", "wb")
        try:  # it dies with this process, even by SIGKILL, its temp dir too
            self.child = ChildProcess.python_module(
                "ray.scripts.scripts", args, str(self.temp_dir), env,
                stdout=log, stderr=log, cwd=os.getcwd(),
            )  # fmt: skip
        finally:
            log.close()
        self.address: str = self._wait_address(timeout_s)

    def _wait_address(self, timeout_s: float) -> str:
        marker = self.temp_dir / "ray_current_cluster"
        deadline = time.monotonic() + timeout_s
        while not (marker.exists() and marker.read_text().strip()):
            if self.child.popen.poll() is not None or time.monotonic() > deadline:
                tail = (self.temp_dir / "ray-start.log").read_text(errors="replace")[-400:]
                self.stop()
                raise RayClusterError(f"the local Ray cluster did not start: {tail.strip()}")
            time.sleep(0.05)
        return marker.read_text().strip()

    def stop(self, grace_s: float = 0.0) -> None:
        """SIGTERM the group, SIGKILL it and the session after ``grace_s``; bounded.
        Nothing of the cluster outlives the run, so no graceful drain is waited for
        (the head's takes over a second: a Ctrl-C's whole budget)."""
        try:
            self.child.stop(grace_s)  # removes the temp dir
        finally:
            if self.saved_env is not None:
                restore_auth(self.saved_env)
                self.saved_env = None


def use_auth(values: dict[str, str]) -> dict[str, str | None]:
    """Point this process's Ray at ``values`` (``RAY_AUTH_*``) for the connection's life
    (Ray's core worker rereads the token); returns what to put back afterwards."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    _reload_auth()
    return saved


def restore_auth(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _reload_auth()


def _reload_auth() -> None:
    # Ray caches the token it read first; its own test helpers reset it like this.
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]
    from ray._raylet import Config as RayConfig  # type: ignore[attr-defined]

    RayConfig.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def check_resources(settings: RolloutConfig) -> None:
    """Refuse ``rollout.resources`` that no node of the connected cluster offers (each
    actor's amount on one node): Ray would keep the actors pending until the start
    deadline. Blocking."""
    import ray

    if not settings.resources:
        return
    alive = [node for node in ray.nodes() if node.get("Alive")]  # type: ignore[no-untyped-call]
    nodes = [node.get("Resources", {}) for node in alive]
    if any(all(have.get(k, 0) >= v for k, v in settings.resources.items()) for have in nodes):
        return
    offered = sorted({k for have in nodes for k in have if not k.startswith("node:")})
    raise ConfigError(
        f"`$.rollout.resources` = {settings.resources}: no node of the Ray cluster offers "
        f"them (its nodes' resources: {', '.join(offered)})"
    )


def connect(
    settings: RolloutConfig, num_workers: int, started: Callable[[LocalCluster], None]
) -> None:
    """``ray.init`` against ``settings.address``, or a local cluster started here and
    handed to ``started`` at once (the caller stops it, even if this call is
    cancelled). Blocking."""
    import logging

    import ray

    address = settings.address
    if not address:
        num_cpus = settings.num_cpus or max(1, round(num_workers * settings.actor_cpus))
        cluster = LocalCluster(num_cpus, settings.start_timeout_s)
        started(cluster)
        address = cluster.address
        cluster.saved_env = use_auth(cluster.auth)
    # corun owns the signals (connect runs off the main thread, where Ray says so).
    logging.getLogger("ray._private.worker").addFilter(_not_the_sigterm_note)
    try:
        ray.init(
            address=address, log_to_driver=False, logging_level=logging.WARNING,
            configure_logging=False,
        )  # fmt: skip
    except Exception as exc:
        where = f"`$.rollout.address` = {address!r}" if settings.address else "local Ray"
        raise RayClusterError(f"{where}: cannot connect ({exc})") from exc


def _not_the_sigterm_note(record: object) -> bool:
    return "SIGTERM handler is not set" not in str(getattr(record, "msg", ""))
