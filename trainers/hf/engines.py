"""Choosing and starting the rollout engine of an HF policy (``trainer.engine``):

- ``local``: transformers forward passes in this process (trainers/hf/engine.py);
- ``vllm``: a vLLM engine in this process (trainers/hf/vllm_engine.py);
- ``vllm-server``: a vLLM OpenAI server as a child process (trainers/hf/vllm_server.py).

The vLLM engines need the ``vllm`` extra (``pip install -e '.[vllm]'``); they are
imported only when chosen. A start-up that fails or is interrupted ends what it began
(the engines' ``start``); a started engine's shutdown is registered for teardown.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from corun import ConfigError, SetupContext
from corun.compute import Lane
from corun.engine import Engine
from trainers.hf.policy import HFPolicy
from trainers.hf.vllm_engine import EngineOptions, VLLMConfig

EngineKind = Literal["local", "vllm", "vllm-server"]


def check_engine(kind: EngineKind, options: EngineOptions, interrupt: bool) -> None:
    """Options the chosen engine does not take: a usage error naming the setting."""
    if kind == "local":
        default = EngineOptions()
        for name in options.__struct_fields__:
            if getattr(options, name) != getattr(default, name):
                raise ConfigError(
                    f'`$.trainer.engine_options.{name}`: the "local" engine has no such option '
                    '(it applies to "vllm" and "vllm-server")'
                )
    elif interrupt:
        raise ConfigError(
            f'`$.trainer.inflight_at_sync` = "interrupt": the {kind!r} engine cannot switch '
            'weights under a running request (it drains them); use "drain"'
        )


async def start_engine(
    kind: EngineKind, options: EngineOptions, policy: HFPolicy, pad_id: int,
    ctx: SetupContext, *, interrupt: bool,
) -> Engine:  # fmt: skip
    """Start the engine on the policy's current weights (version 0)."""
    check_engine(kind, options, interrupt)
    loop = ctx.config.loop
    if kind == "local":
        from trainers.hf.engine import TransformersEngine

        # At concurrency 1 rollouts and updates alternate on the train lane, as in a
        # hand-written loop; above it the engine generates on its own.
        shared = loop.concurrency == 1 and ctx.lane is not None
        lane = ctx.lane if shared else Lane("engine", loop.compute, loop.lane_threads)
        assert lane is not None
        engine = TransformersEngine(policy, pad_id, lane, owns_lane=not shared, interrupt=interrupt)
        ctx.on_teardown("engine", engine.shutdown)
        return engine
    settings = VLLMConfig(model=str(policy.source), **_fields(options))
    started: Engine
    if kind == "vllm":
        from trainers.hf.vllm_engine import VLLMEngine

        started = await VLLMEngine.start(settings)
    else:
        from trainers.hf.vllm_server import VLLMServerEngine

        started = await VLLMServerEngine.start(settings)
    ctx.on_teardown("engine", started.shutdown)
    # vLLM loaded the directory's weights; the policy may differ (a warm start).
    await started.update_weights(policy.weights(), 0)
    return started


def _fields(options: EngineOptions) -> dict[str, Any]:
    return msgspec.structs.asdict(options)
