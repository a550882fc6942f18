"""How an hf: policy trains, the same for every hf kind: its compute precision, LoRA
adapters, activation checkpointing, and how it spreads over the torchrun ranks
(``run.parallel``: corun/execution/parallel.py shards each decoder layer and then the
rest of the model).

:func:`prepare_policy` applies them, in that order, to a freshly loaded (and
warm-started) policy already on the run's device (``fully_shard`` shards a model where
it is), before anything builds an optimizer over its parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import msgspec
from torch import nn

from corun.base.config import Config
from corun.execution import parallel
from corun.execution.parallel import Precision
from trainers.hf.lora import LoraSettings, add_lora
from trainers.hf.policy import HFPolicy

if TYPE_CHECKING:
    import torch


class ModelSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Keys of ``[trainer]`` in every hf kind."""

    # The precision of the policy's forward and backward passes. The weights the
    # optimizer updates and its state stay float32 either way (mixed precision); on
    # CPU "bfloat16" runs, slower than float32, and learns.
    dtype: Precision = "float32"
    # Recompute each decoder layer's activations in the backward pass instead of
    # keeping them: less memory for a longer step.
    activation_checkpointing: bool = False
    # [trainer.lora]: train low-rank adapters only (the base weights stay frozen, and
    # only the adapters are checkpointed and synced to the engine).
    lora: LoraSettings | None = None


class PolicySettings(Protocol):
    """What :func:`prepare_policy` reads: :class:`ModelSettings`' keys, in any config."""

    @property
    def dtype(self) -> Precision: ...
    @property
    def activation_checkpointing(self) -> bool: ...
    @property
    def lora(self) -> LoraSettings | None: ...


def prepare_policy(policy: HFPolicy, settings: PolicySettings, config: Config) -> HFPolicy:
    """``policy`` with its LoRA adapters, precision and sharding (in place)."""
    with_adapters(policy, settings, config)
    return parallelize_policy(policy, settings, config)


def with_adapters(policy: HFPolicy, settings: PolicySettings, config: Config) -> HFPolicy:
    """``policy`` with the LoRA adapters ``settings`` ask for (in place)."""
    if settings.lora is not None:
        add_lora(policy, settings.lora, config.run.seed)
    return policy


def parallelize_policy(policy: HFPolicy, settings: PolicySettings, config: Config) -> HFPolicy:
    """``policy`` computing in its precision and spread over the ranks (in place)."""
    parallel.parallelize(
        policy, strategy=config.run.parallel, blocks=decoder_layers(policy),
        methods=("hidden", "head"), dtype=compute_dtype(settings),
        checkpointing=settings.activation_checkpointing,
    )  # fmt: skip
    return policy


def compute_dtype(settings: PolicySettings) -> torch.dtype:
    return parallel.DTYPES[settings.dtype]


def decoder_layers(policy: HFPolicy) -> list[nn.Module]:
    """The model's repeated blocks: the module list with one entry per hidden layer."""
    count = int(getattr(policy.model.config, "num_hidden_layers", 0) or 0)
    for module in policy.model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return list(module)
    return []
