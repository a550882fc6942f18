"""Small pieces every trainer family needs the same way: rebuilding a model from a
checkpoint's state, warm starts, the optimizer update with gradient clipping, and a
frozen copy of a model (KL anchors, rollout samplers)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import msgspec
import torch
from torch import nn

from corun import checkpoint, pipeline
from corun.errors import CheckpointError

M = TypeVar("M", bound=nn.Module)


def rebuild(model_cls: Callable[[Any], M], config_cls: type[Any], state: dict[str, Any]) -> M:
    """The model of a trainer ``state_dict()`` (``model_config`` + ``model``).

    Built on the meta device: no init work, and no draws from the global RNG that
    would shift the caller's random stream.
    """
    with torch.device("meta"):
        model = model_cls(msgspec.convert(state["model_config"], config_cls))
    model.to_empty(device="cpu")
    model.load_state_dict(state["model"])
    return model


def warm_start(init_from: str, load: Callable[[dict[str, Any]], M], what: str) -> M:
    """The model in a checkpoint, given its directory or its run's config; a checkpoint
    of something else is a usage error naming the path."""
    path = pipeline.checkpoint_for(init_from)
    _, state = checkpoint.read(path)
    try:
        return load(state)
    except (KeyError, TypeError, ValueError, RuntimeError, msgspec.ValidationError) as exc:
        raise CheckpointError(f"{path}: not a {what} checkpoint ({exc})") from None


def apply_update(
    params: Iterable[nn.Parameter], optimizer: torch.optim.Optimizer, grad_clip: float
) -> float:
    """Clip the gradients' global norm at ``grad_clip`` (0: no clipping), step the
    optimizer, and return the norm before clipping."""
    params = list(params)
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    optimizer.step()
    return float(norm)


def frozen_copy(model: M) -> M:
    """A copy in eval mode without gradients."""
    frozen = copy.deepcopy(model).eval()
    for p in frozen.parameters():
        p.requires_grad_(False)
    return frozen
