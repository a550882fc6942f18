"""What an hf: policy's weight sync sends its engine, and how it is checked.

- **Whole weights** (no LoRA): the state dict; from a sharded policy (``run.parallel =
  "fsdp"``) gathered a bucket at a time as the engine reads it
  (``trainer.sync_bucket_bytes``), never a second whole copy on the rank.
- **The adapter** (``[trainer.lora]``): every built-in engine takes one — the local
  transformers engine copies it into its own LoRA layers, vLLM (in process or as a
  server) loads it as its own LoRA adapter per version, keeping ``loop``'s staleness
  bound + 1 versions so a generation in flight finishes on the adapter it started
  with.
- **Merged weights** (base + the adapter's product) under LoRA for an engine that takes
  no adapters (one of your own): as large as a full sync.

corun/engines/fingerprint.py's ``sync_verified`` sends and checks; this module decides
what, and the trained fingerprint.

Each sync is verified by the engine's fingerprint of what it serves
(corun/engines/fingerprint.py), the trained side rounded to the engine's precision
and, when sharded, summed over every rank's shards.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
import torch
from torch import Tensor

from corun.base.config import LoopConfig
from corun.contract.engine import Adapter, Engine
from corun.engines.fingerprint import MOD, bits_sum, format_fingerprint, sync_verified
from corun.engines.lora import takes_adapters
from corun.engines.options import EngineOptions, engine_dtype
from corun.execution import parallel
from corun.execution.compute import ComputeMode, Lane, blocking_io
from trainers.hf.lora import adapter, is_lora, merged_weights
from trainers.hf.policy import HFPolicy


def engine_options(config: Any, loop: LoopConfig) -> EngineOptions:
    """``[trainer.engine_options]``, with LoRA's rank and enough adapter slots for every
    version a rollout may still be generating with."""
    options: EngineOptions = config.engine_options
    if config.lora is None:
        return options
    slots = max(options.max_loras, loop.staleness_bound + 1)
    return msgspec.structs.replace(options, lora_rank=config.lora.rank, max_loras=slots)


def sends_adapter(engine: Engine, policy: HFPolicy) -> bool:
    """Whether syncs send the adapter alone (LoRA, and an engine that takes adapters)."""
    return is_lora(policy) and takes_adapters(engine)


async def sync(
    engine: Engine, policy: HFPolicy, config: Any, version: int, lane: Lane | None,
    mode: ComputeMode,
) -> str:  # fmt: skip
    """Send ``policy``'s trained weights (or adapter) to ``engine`` as ``version`` and
    check the engine's fingerprint against the trained one; returns it. A sharded
    policy gathers on ``lane`` (collectives in the same order on every rank, beside
    nothing else: the engine shares the train lane at concurrency 1), a whole one sums
    in a worker thread."""
    if parallel.is_sharded(policy):
        trained, weights, sent = await on_lane(lane, _prepared, engine, policy, config)
    else:
        trained, weights, sent = await blocking_io(mode, _prepared, engine, policy, config)
    return await sync_verified(engine, weights, version, adapter=sent, trained=trained)


def _prepared(
    engine: Engine, policy: HFPolicy, config: Any
) -> tuple[str, Mapping[str, Tensor], Adapter | None]:  # fmt: skip
    """The trained fingerprint, the weights and the adapter to send: the adapter alone
    (LoRA to an engine that takes one), merged weights (LoRA to one that does not) or
    the weights, gathered as read when sharded."""
    trained = trained_fingerprint(engine, policy, config)
    if sends_adapter(engine, policy):
        return trained, {}, adapter(policy)
    if is_lora(policy):
        return trained, merged_weights(policy), None
    if parallel.is_sharded(policy):
        return trained, parallel.GatheredState(policy.weights(), config.sync_bucket_bytes), None
    return trained, policy.weights(), None


async def on_lane(lane: Lane | None, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on ``lane``, or here when there is none (inline set-up)."""
    return fn(*args) if lane is None else await lane.run(fn, *args)


def trained_fingerprint(engine: Engine, policy: HFPolicy, config: Any) -> str:
    """The fingerprint of the weights the engine should serve, in its precision: the
    policy's (base and adapter), summed over the shards of every rank when sharded (a
    collective), or, merged for an engine that takes no adapter, the merged weights."""
    dtype = engine_dtype(config.engine_options)
    if is_lora(policy) and not takes_adapters(engine):
        return format_fingerprint(bits_sum(merged_weights(policy).values(), dtype))
    state = policy.weights()
    if not is_lora(policy):
        return format_fingerprint(_summed(state.values(), policy, dtype))
    # The frozen base's sum once; each sync sums the adapters alone.
    cache: dict[torch.dtype, int] = policy.__dict__.setdefault("base_bits", {})
    if dtype not in cache:
        cache[dtype] = _summed((t for n, t in state.items() if "lora_" not in n), policy, dtype)
    adapters = _summed((t for n, t in state.items() if "lora_" in n), policy, dtype)
    return format_fingerprint(cache[dtype] + adapters)


def _summed(tensors: Iterable[Tensor], policy: HFPolicy, dtype: torch.dtype) -> int:
    """The bit sum of ``tensors``, over the shards of every rank when sharded (a
    collective)."""
    if not parallel.is_sharded(policy):
        return bits_sum(tensors, dtype)
    mine = [t for t in map(parallel.on_rank_zero_replica, tensors) if t is not None]
    return parallel.world_sum(bits_sum(mine, dtype), MOD)
