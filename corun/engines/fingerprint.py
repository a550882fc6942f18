"""Fingerprints of model weights, and a weight sync that checks one: after each sync
the engine reports the fingerprint of the weights it serves, computed from its own
copy (each engine's ``fingerprint``), and the run compares it with the trained
state's, so an engine that did not reload fails the run with one line naming the
version instead of quietly sampling from old weights.

The fingerprint is the sum of every element's bit pattern, modulo 2**64, as 16 hex
digits. A sum, because an engine does not hold the trainer's tensors as they are:
vLLM fuses q/k/v and gate/up projections into one tensor, pads the vocabulary with
zero rows (whose bit pattern is 0) and, on CPU, repacks linear weights for oneDNN
(corun/engines/vllm_worker.py sums them before the repacking). A sum of exact integers
does not depend on order, layout or how tensors are split, and two copies of the same
values give the same sum on any machine. Floating-point tensors of up to 32 bits are
summed as float32 bit patterns (widening is exact, so a bfloat16 state and the float32
copy an engine loaded from it agree), float64 ones as their 64-bit patterns, integer
and boolean tensors as their values. A tensor listed twice (tied weights: a state dict
holds the embedding under two names) counts once, as an engine holds it once.

An engine may hold the weights in a lower precision than the trainer's float32 master
weights (``[trainer.engine_options] dtype``): the trained state's fingerprint is then
taken of its floating-point tensors rounded to the engine's dtype (``dtype=``; the
rounding is torch's, as the engine's own copy into its weights), which the engine's
fingerprint of what it holds equals.

With a LoRA adapter (``update_adapter``) an engine's fingerprint is of its base weights
plus the adapter's tensors, as the trainer's state dict (peft's layers injected) holds
them; what each engine sums is in its docstring.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from corun.contract.engine import Adapter, AdapterEngine, Engine, EngineError
from corun.execution.compute import ComputeMode, blocking_io

MASK32 = 0xFFFFFFFF
MOD = 2**64
CHUNK = 1 << 24  # elements summed at once: the int64 copy of a chunk is 128 MiB


def bits_sum(tensors: Iterable[Tensor], dtype: torch.dtype | None = None) -> int:
    """The sum of the bit patterns of every element of ``tensors`` (mod 2**64),
    floating-point ones first rounded to ``dtype`` if given; a tensor sharing storage,
    shape and strides with an earlier one is skipped."""
    seen: set[tuple[object, ...]] = set()
    total = 0
    for tensor in tensors:
        tensor = tensor.detach()
        if tensor.numel() == 0 or tensor.is_meta:
            continue
        key = (tensor.device, tensor.dtype, tensor.data_ptr(), tensor.shape, tensor.stride())
        if key in seen:
            continue
        seen.add(key)
        flat = tensor.reshape(-1)
        cast = dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype
        for start in range(0, flat.numel(), CHUNK):  # cast by chunk: no full copy
            chunk = flat[start : start + CHUNK]
            total += _chunk_sum(chunk.to(dtype) if cast else chunk)
    return total % MOD


def _chunk_sum(chunk: Tensor) -> int:
    if chunk.is_complex():
        return _chunk_sum(torch.view_as_real(chunk).reshape(-1))
    if chunk.is_floating_point() and chunk.element_size() <= 4:
        return int((chunk.float().view(torch.int32).long() & MASK32).sum())
    words = chunk.view(torch.int64) if chunk.is_floating_point() else chunk.long()
    # 64-bit words: their halves, each summed exactly, so no sum wraps in torch.
    low = int((words & MASK32).sum())
    high = int(((words >> 32) & MASK32).sum())
    return low + (high << 32)


def format_fingerprint(total: int) -> str:
    return f"{total % MOD:016x}"


def weights_fingerprint(tensors: Iterable[Tensor], dtype: torch.dtype | None = None) -> str:
    """The fingerprint of ``tensors`` (a state dict's values, a model's parameters);
    with ``dtype``, of their floating-point values rounded to it (an engine's precision:
    corun.engines.options.engine_dtype)."""
    return format_fingerprint(bits_sum(tensors, dtype))


async def sync_verified(
    engine: Engine, state: Mapping[str, Tensor], version: int, *,
    mode: ComputeMode = "thread", dtype: torch.dtype | None = None,
    adapter: Adapter | None = None, trained: str | None = None,
) -> str:  # fmt: skip
    """``engine.update_weights(state, version)`` — or, with ``adapter``,
    ``engine.update_adapter(adapter, version)`` — then check that the engine serves
    ``state`` (the trained model's whole state dict, base and adapter): its fingerprint
    must equal the state's, rounded to ``dtype`` (the engine's precision) if given.
    Returns the fingerprint; a mismatch is an :class:`EngineError` naming the version
    and both fingerprints, as is an adapter for an engine that takes none.
    ``mode``: the run's compute mode (``loop.compute``; "inline" uses no threads).
    ``trained``: the state's fingerprint when the caller has it (then ``state`` is not
    read for it: a sharded state's is summed over the ranks, a LoRA base's kept)."""
    if trained is None:  # summed in a worker thread: a large model takes a second or so
        trained = await blocking_io(mode, weights_fingerprint, list(state.values()), dtype)
    if adapter is None:
        await engine.update_weights(state, version)
    elif isinstance(engine, AdapterEngine):
        await engine.update_adapter(adapter, version)
    else:
        raise EngineError(f"adapter sync to version {version}: the engine takes no adapters")
    what = "adapter sync" if adapter is not None else "weight sync"
    return checked(await engine.fingerprint(), trained, f"{what} to version {version}")


def checked(served: str, trained: str, what: str) -> str:
    """``served`` if it is ``trained``; else an :class:`EngineError` naming ``what`` (a
    sync, the start) and both fingerprints."""
    if served != trained:
        raise EngineError(
            f"{what}: the engine serves weights {served}, not the trained {trained} "
            "(it did not reload them)"
        )
    return served
