"""``corun.run``: the loop template (corun/loop/template.py) with the optional parts a
config asks for, assembled here, outside the loop:

- Ray rollout workers (corun/scale/ray_workers.py) with ``[rollout] backend = "ray"``;
- the policy endpoint (corun/serve/server.py) with ``[serve] enabled``, or for
  ``corun serve`` (a serve-only session); with ``serve.tinker``, the Tinker server of
  the trainer's models (corun/serve/tinker/) in its place;
- the prerequisite runs a trainer names (``Trainer.prerequisites()``), each trained by
  this same function, unless complete already (corun/records/prerequisites.py).

The command line, embedding (``corun.training``) and the public ``corun.run`` all start
runs through :func:`run`.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from corun.base.config import Config
from corun.base.errors import ConfigError
from corun.contract.config_file import load_config
from corun.contract.episodes import EpisodeInbox
from corun.contract.registry import resolve_trainer
from corun.contract.trainer import Outcome, Trainer
from corun.loop import template
from corun.loop.extensions import Extensions
from corun.loop.lanes import lane
from corun.loop.session import Session
from corun.loop.teardown import RunControl
from corun.records.prerequisites import final_checkpoint
from corun.scale.ray_workers import RayWorkers
from corun.serve.engine_server import EngineServer
from corun.serve.server import Endpoint
from corun.serve.tinker.server import TinkerServer

T = TypeVar("T")


async def run(
    trainer: Trainer[Any], config: Config, *, control: RunControl | None = None,
    session: Session | None = None,
) -> Outcome:  # fmt: skip
    """Train ``trainer`` to ``config.run.steps`` and tear down, on every path.

    Returns the outcome when the run finishes or is stopped through ``control`` (or
    the embedding ``session``'s); re-raises the first training error, or the host's
    cancellation, after teardown.
    """
    session = session or Session()
    parts = extensions(trainer, config, session)
    return await template.run(trainer, config, control=control, session=session, extensions=parts)


def extensions(trainer: Trainer[Any], config: Config, session: Session) -> Extensions:
    """The optional parts of the run of ``trainer`` on ``config``, as the config asks."""
    on_ray = config.rollout.backend == "ray"
    serves = config.serve.enabled or session.serve_only
    if config.serve.tinker and not session.serve_only:
        raise ConfigError(
            "`$.serve.tinker`: the Tinker API is served by `corun serve CONFIG`, not while "
            "the config trains"
        )
    return Extensions(
        remote=partial(RayWorkers.start, trainer, config) if on_ray else None,
        service=partial(_endpoint, trainer, config, session.inbox) if serves else None,
        prerequisites=_PrerequisiteRuns(config.log.progress),
    )


def _endpoint(
    trainer: Trainer[Any], config: Config, inbox: EpisodeInbox
) -> Endpoint | TinkerServer | EngineServer:
    """The endpoint of the set-up trainer's policy, on a lane of its own (with
    ``serve.tinker``: the Tinker server of its models; ``serve.fleet``: its rollout
    engine for a training run's fleet)."""
    serve_lane = lane(config, "serve")
    kind = config.trainer.kind

    def required(found: T | None, why: str) -> T:
        if found is None:
            serve_lane.close()
            raise ConfigError(why)
        return found

    if config.serve.fleet:
        engine = required(trainer.rollout_engine(), (
            f"`corun engine serve`: trainer {kind!r} has no rollout engine to serve (the "
            "hf_grpo, hf_ppo and hf_agentic kinds do)"))  # fmt: skip
        return EngineServer(engine, config.serve, serve_lane)
    if config.serve.tinker:
        backend = required(trainer.training_backend(), (
            f"`$.serve.tinker`: trainer {kind!r} serves no models to train (the hf_* kinds "
            "do)"))  # fmt: skip
        return TinkerServer(backend, config.serve, serve_lane, config.run_dir)
    policy = required(trainer.served_policy(serve_lane),
                      f"`$.serve.enabled`: trainer {kind!r} serves no policy")  # fmt: skip
    return Endpoint(policy, config.serve, serve_lane, inbox)


class _PrerequisiteRuns:
    """Prerequisite runs, trained by :func:`run` (nested: a stop of the run that needs
    them cancels them too), with the progress display of the run that needs them (its
    process's output: a bench's or a host's ``log.progress = "off"`` holds for both)."""

    def __init__(self, progress: str) -> None:
        self.progress = progress

    def complete(self, config: Path) -> bool:
        return final_checkpoint(load_config(config)) is not None

    async def train(self, config: Path) -> None:
        settings = load_config(config, [f"log.progress={self.progress}"])
        await run(resolve_trainer(settings.trainer.kind)(settings), settings)
