"""What an hf: policy's weight sync sends its engine, and how it is checked.

- **Whole weights** (no LoRA): the state dict; from a sharded policy (``run.parallel =
  "fsdp"``) gathered a bucket at a time as the engine reads it
  (``trainer.sync_bucket_bytes``), never a second whole copy on the rank.
- **An adapter** (``[trainer.lora]``) to an engine that takes adapters — the local
  transformers engine copies it into its own LoRA layers, vLLM in process loads it as
  a ``LoRARequest`` per version, keeping ``loop``'s staleness bound + 1 versions so a
  generation in flight finishes on the adapter it started with.
- **Merged weights** (base + the adapter's product) under LoRA to the vLLM server,
  which takes whole weights only: as large as a full sync (benchmarks: ``parallel``).

Each sync is verified by the engine's fingerprint of what it serves
(corun/engines/fingerprint.py), the trained side rounded to the engine's precision
and, when sharded, summed over every rank's shards.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import torch
from torch import Tensor

from corun.base.config import LoopConfig
from corun.contract.engine import Adapter, AdapterEngine, Engine, EngineError
from corun.engines.fingerprint import MOD, bits_sum, format_fingerprint, sync_verified
from corun.engines.options import EngineOptions, engine_dtype
from corun.execution import parallel
from trainers.hf.lora import adapter, is_lora, merged_weights
from trainers.hf.policy import HFPolicy


def takes_adapter(config: Any) -> bool:
    """Whether syncs send the adapter alone (LoRA, and an engine that takes adapters)."""
    return config.lora is not None and config.engine != "vllm-server"


def engine_options(config: Any, loop: LoopConfig) -> EngineOptions:
    """``[trainer.engine_options]``, with LoRA's rank and enough adapter slots for every
    version a rollout may still be generating with."""
    options: EngineOptions = config.engine_options
    if not takes_adapter(config):
        return options
    slots = max(options.max_loras, loop.staleness_bound + 1)
    return msgspec.structs.replace(options, lora_rank=config.lora.rank, max_loras=slots)


class StartingPolicy:
    """The policy as an engine starts from it: its model (copied by the local engine),
    its directory (loaded by vLLM) and the weights vLLM then loads: under LoRA the
    base's (the adapter follows as its own sync)."""

    def __init__(self, policy: HFPolicy) -> None:
        self.policy = policy

    @property
    def model(self) -> torch.nn.Module:
        return self.policy.model

    @property
    def source(self) -> Path:
        return self.policy.source

    def weights(self) -> dict[str, Tensor]:
        return merged_weights(self.policy) if is_lora(self.policy) else self.policy.weights()


async def sync(
    engine: Engine, policy: HFPolicy, config: Any, version: int, mode: Any
) -> str:  # fmt: skip
    """Send ``policy``'s trained weights (or adapter) to ``engine`` as ``version`` and
    check its fingerprint; returns it. Unsharded only (:func:`sync_sharded` otherwise)."""
    dtype = engine_dtype(config.engine_options)
    if takes_adapter(config):
        return await sync_verified(
            engine, policy.weights(), version, mode=mode, dtype=dtype, adapter=adapter(policy)
        )
    weights = merged_weights(policy) if is_lora(policy) else policy.weights()
    return await sync_verified(engine, weights, version, mode=mode, dtype=dtype)


def sharded_payload(policy: HFPolicy, config: Any) -> Adapter | Mapping[str, Tensor]:
    """What a sharded policy's sync sends (gathering: every rank builds it together):
    its adapter whole, or its weights gathered as they are read."""
    if takes_adapter(config):
        return adapter(policy)
    return parallel.GatheredState(policy.weights(), config.sync_bucket_bytes)


async def send(engine: Engine, payload: Adapter | Mapping[str, Tensor], version: int) -> None:
    if not isinstance(payload, Adapter):
        await engine.update_weights(payload, version)
    elif isinstance(engine, AdapterEngine):
        await engine.update_adapter(payload, version)
    else:
        raise EngineError(f"adapter sync to version {version}: the engine takes no adapters")


def trained_fingerprint(policy: HFPolicy, config: Any) -> str:
    """The fingerprint of the weights the engine should serve, in its precision: the
    policy's (base and adapter), summed over the shards of every rank when sharded (a
    collective), or, merged for an engine that takes no adapter, the merged weights."""
    dtype = engine_dtype(config.engine_options)
    if is_lora(policy) and not takes_adapter(config):
        return format_fingerprint(bits_sum(merged_weights(policy).values(), dtype))
    tensors = policy.weights().values()
    if not parallel.is_sharded(policy):
        return format_fingerprint(bits_sum(tensors, dtype))
    mine = [t for t in map(parallel.on_rank_zero_replica, tensors) if t is not None]
    return format_fingerprint(parallel.world_sum(bits_sum(mine, dtype), MOD))


def check_served(served: str, trained: str, version: int) -> str:
    if served != trained:
        raise EngineError(
            f"weight sync to version {version}: the engine serves weights {served}, not "
            f"the trained {trained} (it did not reload them)"
        )
    return served
