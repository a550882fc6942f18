"""How a trainer's model is spread over the torchrun ranks (``run.parallel``) and in
which precision it computes (a trainer's ``dtype``): torch's FSDP2 (``fully_shard``)
for both strategies, so corun rides on the distributed machinery users already know.

- ``"fsdp"``: parameters, gradients and optimizer state sharded over the ranks (a 1-D
  device mesh); each block (a transformer layer) is all-gathered for its forward and
  backward and freed after, the gradients reduce-scattered. Memory for parameters and
  optimizer state per rank falls with the world size; every block costs an all-gather
  twice per step.
- ``"ddp"``: FSDP2 on a (replicate = W, shard = 1) mesh, which is DDP's semantics:
  every rank holds the whole model and optimizer state, and the gradients are
  all-reduced (averaged). Fastest where the model fits: no all-gathers.

Either way the gradients every rank steps on are the mean over the ranks' gradients
(as one process on the whole batch), the parameters are ``DTensor``s, and
:func:`clip_grad_norm` clips them by their global norm. At world size 1 nothing is
wrapped: the module stays as it is, and a lower precision computes under autocast.

Precision: the master weights and the optimizer state stay in float32; the forward
and backward compute in ``dtype`` (FSDP2's ``MixedPrecisionPolicy``; gradients are
reduced in float32), or under ``torch.autocast`` at world size 1.

A module is entered through its ``forward`` and the methods named in ``methods``
(FSDP2's hooks wrap exactly those); :func:`gathered` holds its own parameters whole for
code that calls into its submodules some other way (decoding with a KV cache).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from corun.execution import device
from corun.execution.distributed import world

Strategy = Literal["ddp", "fsdp"]
Precision = Literal["float32", "bfloat16", "float16"]
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

_meshes: dict[Strategy, Any] = {}


def device_type() -> str:
    """Where a rank's model lives: the run's device (run.device)."""
    return device.current().type


def mesh(strategy: Strategy) -> Any:
    """The device mesh of ``strategy`` over the whole world (made once: a collective)."""
    if strategy not in _meshes:
        from torch.distributed.device_mesh import init_device_mesh

        size = world().size
        if strategy == "fsdp":
            _meshes[strategy] = init_device_mesh(device_type(), (size,), mesh_dim_names=("shard",))
        else:
            _meshes[strategy] = init_device_mesh(
                device_type(), (size, 1), mesh_dim_names=("replicate", "shard")
            )
    return _meshes[strategy]


def parallelize(
    module: nn.Module, *, strategy: Strategy, blocks: Sequence[nn.Module] = (),
    methods: Sequence[str] = (), dtype: torch.dtype = torch.float32,
    checkpointing: bool = False,
) -> nn.Module:  # fmt: skip
    """``module`` prepared for training at this world size, in place: each of ``blocks``
    and then ``module`` itself wrapped by ``fully_shard`` (world size > 1), ``forward``
    and ``methods`` computing in ``dtype``, and ``blocks`` recomputing their
    activations in the backward pass when ``checkpointing`` (memory for compute).
    Call it before building the optimizer: sharding replaces the parameters."""
    if checkpointing:
        for block in blocks:
            _checkpoint_activations(block)
    if not world().parallel:
        if dtype != torch.float32:
            for name in ("forward", *methods):
                _autocast_method(module, name, dtype)
        return module
    from torch.distributed.fsdp import (
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    place = mesh(strategy)
    # float32: each parameter computes and reduces in its own dtype (a float64 model
    # stays float64); a lower precision computes in it and reduces in float32.
    lower = dtype != torch.float32
    precision = MixedPrecisionPolicy(
        param_dtype=dtype if lower else None, reduce_dtype=torch.float32 if lower else None
    )
    for block in blocks:
        fully_shard(block, mesh=place, mp_policy=precision)
    fully_shard(module, mesh=place, mp_policy=precision)
    for name in methods:
        register_fsdp_forward_method(module, name)
    # ``module`` the root of its units now, as its first forward would make it: a unit
    # entered first (a submodule called directly) would otherwise take that role.
    module._get_fsdp_state()._lazy_init()  # type: ignore[operator]
    return module


def _autocast_method(module: nn.Module, name: str, dtype: torch.dtype) -> None:
    """``module.<name>`` computing under autocast to ``dtype`` (this instance only)."""
    method = getattr(module, name)

    @functools.wraps(method)
    def autocast(*args: Any, **kwargs: Any) -> Any:
        where = next(module.parameters()).device.type  # where the module computes
        with torch.autocast(where, dtype=dtype):
            return method(*args, **kwargs)

    setattr(module, name, autocast)


def _checkpoint_activations(block: nn.Module) -> None:
    """``block``'s forward recomputed in backward instead of its activations kept."""
    from torch.utils.checkpoint import checkpoint

    forward = block.forward

    @functools.wraps(forward)
    def recomputed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = recomputed


def is_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` wrapped ``module`` (its parameters are DTensors)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


@contextmanager
def gathered(module: nn.Module) -> Iterator[None]:
    """``module``'s own parameters whole for the block, for calls that do not enter it
    through ``forward`` or a registered method (its sharded blocks gather themselves
    in their forward). Every rank must run the same calls inside."""
    if not is_sharded(module):
        yield
        return
    module.unshard()  # type: ignore[operator]
    try:
        yield
    finally:
        module.reshard()  # type: ignore[operator]


# ----------------------------------------------------------------------------- gradients


def is_dtensor(tensor: Tensor | None) -> bool:
    return isinstance(tensor, DTensor)


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float) -> float:
    """Scale the gradients of ``params`` to a global norm of at most ``max_norm`` (inf:
    only measure) and return the norm before: over every shard of every rank for
    sharded parameters, as one process over the whole model would compute it."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if is_dtensor(g)]
    plain = [g for g in grads if not is_dtensor(g)]
    if not sharded:  # torch's own, bit for bit
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    squares = torch.zeros((), dtype=torch.float64)
    if sharded:
        total = torch.nn.utils.get_total_norm(sharded)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        squares += total.double().square()
    if plain:
        squares += torch.nn.utils.get_total_norm(plain).double().square()
    norm = float(squares.sqrt())
    if max_norm < float("inf") and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for grad in grads:
            grad.mul_(scale)
    return norm


# ----------------------------------------------------------------------------- weights out


def full(tensor: Tensor) -> Tensor:
    """The whole tensor: a sharded one gathered from every rank (a collective)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class GatheredState(Mapping[str, Tensor]):
    """A state dict whose sharded tensors are gathered as they are read, so a weight
    sync streams the model to an engine a bucket at a time instead of holding a whole
    second copy. Reading is a collective: every rank reads the same keys in the same
    order (``items()`` in order, as an engine's load does)."""

    def __init__(self, state: Mapping[str, Tensor], bucket_bytes: int = 1 << 26) -> None:
        self.state = state
        self.bucket_bytes = bucket_bytes

    def __getitem__(self, key: str) -> Tensor:
        return full(self.state[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)

    def items(self) -> Iterator[tuple[str, Tensor]]:  # type: ignore[override]
        """Every tensor whole, at most ``bucket_bytes`` of gathered ones held at once."""
        bucket: list[tuple[str, Tensor]] = []
        held = 0
        for key, tensor in self.state.items():
            whole = full(tensor)
            bucket.append((key, whole))
            held += whole.numel() * whole.element_size() if is_dtensor(tensor) else 0
            if held >= self.bucket_bytes:
                yield from bucket
                bucket, held = [], 0
        yield from bucket

    def values(self) -> Iterator[Tensor]:  # type: ignore[override]
        return (tensor for _, tensor in self.items())


def on_rank_zero_replica(tensor: Tensor) -> Tensor | None:
    """The part of ``tensor`` this rank counts in a sum over the world: its shard, once
    per replica group (None on the other replicas), or the tensor itself if plain."""
    if not isinstance(tensor, DTensor):
        return tensor
    from torch.distributed.tensor import Replicate

    coordinate = list(tensor.device_mesh.get_coordinate() or ())
    for dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate) and coordinate[dim] != 0:
            return None
    return tensor.to_local()


def world_sum(value: int, modulus: int) -> int:
    """``value`` summed over every rank, modulo ``modulus`` (a collective)."""
    if not world().parallel:
        return value % modulus
    values: list[int] = [0] * world().size
    dist.all_gather_object(values, value)
    return sum(values) % modulus
