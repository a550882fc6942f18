"""The sharded part of a checkpoint: tensors that live in shards across the torchrun
ranks (FSDP2's ``DTensor`` parameters and optimizer state, corun/execution/parallel.py),
written by every rank with ``torch.distributed.checkpoint`` into the checkpoint's
``shards/`` directory, and read back at any world size.

In ``trainer.pt`` such a tensor is a marker, ``{"__sharded__": key, "shape": [...],
"dtype": "float32"}``, so the rest of a checkpoint reads as it always did. Loading
fills each marker from ``shards/``:

- into the running trainer's own tensor at the same place (:func:`fill`): a rank reads
  only its shard, whatever world size and strategy wrote the checkpoint (2 ranks → 1,
  ``fsdp`` → ``ddp``);
- or whole, from the marker's shape and dtype (:func:`fill_whole`), for export.

The other direction, a whole tensor saved by one process meeting a sharded one in the
running trainer (1 rank → 2), is :func:`localize`: each rank keeps its slice.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from corun.base.errors import CheckpointError
from corun.execution import distributed

SHARDS_DIR = "shards"
MARK = "__sharded__"
_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.bfloat16,
                                                       torch.float16, torch.float64)}  # fmt: skip


def split(tree: Any, prefix: str = "") -> tuple[Any, dict[str, DTensor]]:
    """``tree`` with each DTensor replaced by its marker, and the DTensors by key."""
    found: dict[str, DTensor] = {}

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, DTensor):
            found[path] = node
            dtype = str(node.dtype).removeprefix("torch.")
            return {MARK: path, "shape": list(node.shape), "dtype": dtype}
        if isinstance(node, dict):
            return {key: walk(value, f"{path}/{key}") for key, value in node.items()}
        if isinstance(node, list | tuple):
            return type(node)(walk(value, f"{path}/{i}") for i, value in enumerate(node))
        return node

    return walk(tree, prefix), found


def is_marker(node: Any) -> bool:
    return isinstance(node, dict) and isinstance(node.get(MARK), str)


def save(tensors: dict[str, DTensor], directory: Path) -> None:
    """Every rank writes its shards of ``tensors`` (a collective on the checkpoint
    group, which no training collective shares); returns on rank 0 once all have.
    Rank 0 makes ``directory``'s parent afresh before the call: no rank may start
    before it has (DCP's planning makes ``directory`` on every rank)."""
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    with distributed.collective_failures("writing a checkpoint's shards"):
        dist.barrier(group=distributed.checkpoint_group())
        dcp_save(tensors, checkpoint_id=directory, process_group=distributed.checkpoint_group())


def fill(tree: Any, template: Any, directory: Path) -> Any:
    """``tree`` with its markers loaded into copies of ``template``'s tensors at the same
    places (a DTensor: this rank's shard; a plain tensor: the whole). A marker with no
    tensor at its place in ``template`` does not fit this trainer."""
    targets: dict[str, torch.Tensor] = {}

    def target(node: dict[str, Any], mine: Any) -> torch.Tensor:
        if not isinstance(mine, torch.Tensor) or list(mine.shape) != node["shape"]:
            raise CheckpointError(
                f"{directory}: sharded tensor {node[MARK]} {node['shape']} has no place in "
                "this trainer's state"
            )
        targets[node[MARK]] = torch.empty_like(mine, dtype=_dtype(node, directory))
        return targets[node[MARK]]

    filled = _replace(tree, template, target)
    _load(targets, directory)
    return filled


def fill_whole(tree: Any, directory: Path) -> Any:
    """``tree`` with each marker loaded whole (its recorded shape and dtype): for reading a
    sharded checkpoint outside a run (export)."""
    targets: dict[str, torch.Tensor] = {}

    def target(node: dict[str, Any], _: Any) -> torch.Tensor:
        targets[node[MARK]] = torch.empty(node["shape"], dtype=_dtype(node, directory))
        return targets[node[MARK]]

    filled = _replace(tree, None, target)
    _load(targets, directory, alone=True)
    return filled


def localize(tree: Any, template: Any) -> Any:
    """``tree`` with each whole tensor whose place in ``template`` holds a DTensor cut to
    that DTensor's layout (this rank's slice; no communication)."""
    from torch.distributed.tensor import distribute_tensor

    if isinstance(template, DTensor) and isinstance(tree, torch.Tensor):
        if isinstance(tree, DTensor) or tree.shape != template.shape:
            return tree
        return distribute_tensor(
            tree.to(template.dtype), template.device_mesh, template.placements, src_data_rank=None
        )
    if isinstance(tree, dict) and isinstance(template, dict):
        return {key: localize(value, template.get(key)) for key, value in tree.items()}
    if isinstance(tree, list | tuple) and isinstance(template, list | tuple):
        pairs = zip(tree, [*template, *[None] * len(tree)], strict=False)
        return type(tree)(localize(value, mine) for value, mine in pairs)
    return tree


def has_sharded(tree: Any) -> bool:
    if is_marker(tree) or isinstance(tree, DTensor):
        return True
    if isinstance(tree, dict):
        return any(has_sharded(value) for value in tree.values())
    if isinstance(tree, list | tuple):
        return any(has_sharded(value) for value in tree)
    return False


def _replace(tree: Any, template: Any, target: Callable[[dict[str, Any], Any], Any]) -> Any:
    if is_marker(tree):
        return target(tree, template)
    if isinstance(tree, dict):
        mine = template if isinstance(template, dict) else {}
        return {key: _replace(value, mine.get(key), target) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        places = list(template) if isinstance(template, list | tuple) else []
        places += [None] * (len(tree) - len(places))
        pairs = zip(tree, places, strict=False)
        return type(tree)(_replace(value, place, target) for value, place in pairs)
    return tree


def _dtype(node: dict[str, Any], directory: Path) -> torch.dtype:
    dtype = _DTYPES.get(str(node.get("dtype")))
    if dtype is None:
        raise CheckpointError(
            f"{directory}: sharded tensor {node[MARK]} of dtype {node['dtype']!r}"
        )
    return dtype


def _load(targets: dict[str, torch.Tensor], directory: Path, alone: bool = False) -> None:
    """Read ``targets`` in place from ``directory`` (each rank its own pieces)."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    if not targets:
        return
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: missing (the checkpoint's sharded tensors)")
    single = alone or not distributed.world().parallel
    try:
        if single:
            with warnings.catch_warnings():  # "assuming ... a single process": it is one
                warnings.simplefilter("ignore", UserWarning)
                dcp_load(targets, checkpoint_id=directory, no_dist=True)
        else:
            dcp_load(targets, checkpoint_id=directory, process_group=distributed.checkpoint_group())
    except Exception as exc:  # DCP raises many types for missing or damaged files
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"{directory}: damaged sharded checkpoint: {first}") from None
