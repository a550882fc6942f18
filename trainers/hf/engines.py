"""Choosing and starting the rollout engine of an HF policy (``trainer.engine``):

- ``local``: transformers forward passes in this process (trainers/hf/engine.py);
- ``vllm``: a vLLM engine in this process (trainers/hf/vllm_engine.py);
- ``vllm-server``: a vLLM OpenAI server as a child process (trainers/hf/vllm_server.py).

The vLLM engines need the ``vllm`` extra (``pip install -e '.[vllm]'``); they are
imported only when chosen. The engine's shutdown is registered for teardown before
it starts, so a start-up that fails or is interrupted still ends what it began.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from corun import ConfigError, SetupContext
from corun.compute import Lane
from corun.engine import Engine
from trainers.hf.policy import HFPolicy

EngineKind = Literal["local", "vllm", "vllm-server"]


class EngineSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[trainer.engine_options]``: settings of the vLLM engines."""

    # KV cache size (VLLM_CPU_KVCACHE_SPACE); small models need little.
    kv_cache_gb: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    # Sequences vLLM schedules at once.
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1)] = 256
    # vllm-server: how long start-up may take before the run fails.
    startup_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0


def check_engine(kind: EngineKind, options: EngineSettings, interrupt: bool) -> None:
    """Options the chosen engine does not take: a usage error naming the setting."""
    if kind == "local":
        default = EngineSettings()
        for name in options.__struct_fields__:
            if getattr(options, name) != getattr(default, name):
                raise ConfigError(
                    f'`$.trainer.engine_options.{name}`: the "local" engine has no such option '
                    '(it applies to "vllm" and "vllm-server")'
                )
    if kind == "vllm-server" and interrupt:
        raise ConfigError(
            '`$.trainer.inflight_at_sync` = "interrupt": the "vllm-server" engine cannot '
            'switch weights under a running request; use "drain"'
        )


async def start_engine(
    kind: EngineKind, options: EngineSettings, policy: HFPolicy, pad_id: int,
    ctx: SetupContext, *, interrupt: bool,
) -> Engine:  # fmt: skip
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
    raise ConfigError(f"`$.trainer.engine` = {kind!r}: not available yet")
