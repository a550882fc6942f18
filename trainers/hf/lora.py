"""LoRA for an HF policy (``[trainer.lora]``): low-rank adapters injected with ``peft``
into the policy's own model, in place, so :class:`HFPolicy`'s hidden states and head
run through them unchanged; every base weight is frozen and only the adapters train,
checkpoint and travel to the engines.

The adapter leaves in ``peft``'s own shapes: :func:`adapter` is what an engine that
takes adapters loads (adapter_config.json's contents and adapter_model.safetensors'
tensor names, so vLLM's ``LoRARequest`` and ``peft.PeftModel`` read it),
:func:`save_adapter` writes that directory, and :func:`merged_weights` is the plain
state dict of base plus adapter for engines (and exports) that take full weights only.

peft's default initialisation — A random, B zero — makes the adapted model start equal
to the base; it is drawn from the run's seed without consuming the global RNG.

Under FSDP (``fully_shard``), :func:`add_lora` comes first: sharding replaces the
parameters, and the frozen base and trainable adapters shard together. Then
:func:`adapter_state` holds shards (for torch.distributed.checkpoint), while
:func:`adapter` and :func:`merged_items` gather whole tensors, a collective.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import torch
from torch import Tensor, nn

from corun import CheckpointError, ConfigError
from corun.contract.engine import Adapter

if TYPE_CHECKING:
    from peft import LoraConfig

    from trainers.hf.policy import HFPolicy

ADAPTER = "default"  # peft's adapter name: the policy carries one adapter
PREFIX = "base_model.model."  # what PeftModel puts before the model's own module names
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
WHERE = "`$.trainer.lora.target_modules`"
# Layer kinds peft's LoRA adapts (a target module must be one of these).
ADAPTABLE = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)


LLAMA_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Measured on hf_grpo over seeds (docs/huggingface.md, "LoRA and bfloat16").
LORA_LR_SCALE = 2.0
LORA_B_LR_RATIO = 8.0


def param_groups(
    model: nn.Module, settings: LoraSettings | None, lr: float
) -> list[dict[str, Any]]:
    """The optimizer's parameter groups of ``model``'s trained parameters: one at ``lr``;
    with LoRA, A at ``lr_scale`` times it and B at ``b_lr_ratio`` times A's (LoRA+)."""
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if settings is None:
        return [{"params": [p for _, p in trained]}]
    rate = lr * settings.lr_scale
    b = [p for name, p in trained if ".lora_B." in name]
    rest = [p for name, p in trained if ".lora_B." not in name]
    return [{"params": rest, "lr": rate}, {"params": b, "lr": rate * settings.b_lr_ratio}]


class LoraSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[trainer.lora]``: train low-rank adapters instead of the model's weights."""

    # The adapters' rank r: each adapted weight W (out x in) trains B (out x r) @ A (r x in).
    rank: Annotated[int, msgspec.Meta(ge=1)] = 8
    # The update is scaled by alpha / rank: alpha sets its size whatever the rank.
    alpha: Annotated[float, msgspec.Meta(gt=0)] = 16.0
    # A learns at trainer.lr times this: at a full fine-tune's rate, adapters from a
    # zero B learn too slowly.
    lr_scale: Annotated[float, msgspec.Meta(gt=0)] = LORA_LR_SCALE
    # B learns at this multiple of A's rate (LoRA+, Hayou et al. 2024): with equal
    # rates, B's small updates hold the product back.
    b_lr_ratio: Annotated[float, msgspec.Meta(gt=0)] = LORA_B_LR_RATIO
    # Dropout on the adapters' input while training (0: none; the base path never drops).
    dropout: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.0
    # The modules adapted, by name or name suffix (as peft matches them): a Llama's
    # attention and MLP projections (attention alone learned less: docs/huggingface.md).
    target_modules: Annotated[list[str], msgspec.Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: list(LLAMA_LINEAR)
    )


# ---- injecting


def add_lora(policy: HFPolicy, settings: LoraSettings, seed: int) -> None:
    """Inject ``settings``' adapters into ``policy.model`` in place, initialised from
    ``seed`` (the global RNG is left as it was), and freeze everything else. A target
    that matches no module, or one LoRA cannot adapt, is a usage error naming it."""
    from peft import inject_adapter_in_model

    if is_lora(policy):
        raise ValueError(f"{policy.source}: the policy already has LoRA adapters")
    check_targets(policy.model, settings.target_modules)
    config = lora_config(policy, settings)
    # peft draws lora_A on the CPU when it builds each layer, then moves it to the
    # base weight's device: forking the CPU RNG makes the draw the seed's alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            inject_adapter_in_model(config, policy.model, adapter_name=ADAPTER)
        except ValueError as exc:  # anything check_targets let through
            raise ConfigError(f"{WHERE}: {str(exc).splitlines()[0]}") from None
    for name, param in policy.named_parameters():
        param.requires_grad_(_is_adapter(name))
    policy.__dict__["lora"] = settings  # a plain attribute (lora_settings reads it)


def lora_config(policy: HFPolicy, settings: LoraSettings) -> LoraConfig:
    return _lora_config(policy.source, settings)


def _lora_config(source: Path, settings: LoraSettings) -> LoraConfig:
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,  # type: ignore[arg-type]  # hinted int; any number works
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        base_model_name_or_path=str(source),
        task_type="CAUSAL_LM",
    )


def check_targets(model: nn.Module, targets: list[str]) -> None:
    """Each target names (or ends the name of) an adaptable layer, as peft matches
    them; otherwise one line naming the setting and some names the model has."""
    modules = dict(model.named_modules())
    for target in targets:
        hits = [m for name, m in modules.items() if name == target or name.endswith(f".{target}")]
        if not hits:
            have = _adaptable_names(modules)
            raise ConfigError(
                f"{WHERE}: {target!r} matches no module of the model (it has "
                f"{', '.join(have[:8])}{', ...' if len(have) > 8 else ''})"
            )
        if not all(isinstance(m, ADAPTABLE) or _is_conv1d(m) for m in hits):
            kind = next(type(m).__name__ for m in hits if not isinstance(m, ADAPTABLE))
            raise ConfigError(
                f"{WHERE}: {target!r} is a {kind}; LoRA adapts linear, embedding and "
                "convolution layers"
            )


def _adaptable_names(modules: dict[str, nn.Module]) -> list[str]:
    """The distinct last names of the model's adaptable layers, in model order."""
    names = [n.rsplit(".", 1)[-1] for n, m in modules.items() if n and isinstance(m, ADAPTABLE)]
    return list(dict.fromkeys(names))


def _is_conv1d(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

    return isinstance(module, Conv1D)


def _is_adapter(name: str) -> bool:
    """Whether a parameter of the injected model is an adapter's (peft's ``lora_``)."""
    return any(part.startswith("lora_") for part in name.split("."))


def lora_settings(policy: HFPolicy) -> LoraSettings | None:
    """The settings :func:`add_lora` injected with (None for a full-weight policy)."""
    settings = policy.__dict__.get("lora")
    return settings if isinstance(settings, LoraSettings) else None


def is_lora(policy: HFPolicy) -> bool:
    return lora_settings(policy) is not None


def trainable_parameters(policy: HFPolicy) -> list[nn.Parameter]:
    """The parameters that train: the adapters' under LoRA."""
    return [p for p in policy.parameters() if p.requires_grad]


# ---- the adapter: for engines, checkpoints and files


def _adapter_parameters(policy: HFPolicy) -> dict[str, nn.Parameter]:
    """The adapters' parameters under peft's saved names: the model's names without the
    adapter name (``model.layers.0.self_attn.q_proj.lora_A.weight``), as
    ``get_peft_model_state_dict`` gives them."""
    if not is_lora(policy):
        raise ValueError(f"{policy.source}: the policy has no LoRA adapters (add_lora)")
    return {
        name.replace(f".{ADAPTER}", ""): param
        for name, param in policy.model.named_parameters()
        if _is_adapter(name)
    }


def adapter_state(policy: HFPolicy) -> dict[str, Tensor]:
    """The adapter weights for a checkpoint, under peft's saved names (live tensors,
    detached: the runtime snapshots them; FSDP's shards, as DTensors, when sharded)."""
    return {name: param.detach() for name, param in _adapter_parameters(policy).items()}


def load_adapter_state(policy: HFPolicy, state: dict[str, Tensor]) -> None:
    """Restore :func:`adapter_state`; a state of other adapters (names or shapes) is
    refused in one line."""
    params = _adapter_parameters(policy)
    missing, extra = sorted(params.keys() - state.keys()), sorted(state.keys() - params.keys())
    if missing or extra:
        which = f"lacks {missing[0]}" if missing else f"has {extra[0]}, which the policy lacks"
        raise CheckpointError(
            f"the checkpoint's adapter is not the policy's: it {which} "
            f"({len(missing)} missing, {len(extra)} extra)"
        )
    for name, param in params.items():
        if tuple(state[name].shape) != tuple(param.shape):
            raise CheckpointError(
                f"the checkpoint's adapter is not the policy's: {name} is "
                f"{tuple(state[name].shape)}, not {tuple(param.shape)} (another rank?)"
            )
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(_placed_like(state[name], param))


def _placed_like(value: Tensor, param: Tensor) -> Tensor:
    """``value`` (a whole tensor, or one sharded as ``param`` is) as ``param`` holds it:
    a whole tensor is sharded like a parameter that FSDP sharded."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor) and not isinstance(value, DTensor):
        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
    return value


def adapter_config(policy: HFPolicy) -> dict[str, Any]:
    """adapter_config.json's contents, as ``PeftModel.save_pretrained`` writes them."""
    settings = lora_settings(policy)
    if settings is None:
        raise ValueError(f"{policy.source}: the policy has no LoRA adapters (add_lora)")
    return _adapter_config(policy.source, settings)


def _adapter_config(source: Path, settings: LoraSettings) -> dict[str, Any]:
    config = _lora_config(source, settings).to_dict()
    config["inference_mode"] = True  # what save_pretrained records
    config["target_modules"] = sorted(config["target_modules"])
    # Through JSON: enums as their values, sets as lists, exactly what the file holds.
    loaded: dict[str, Any] = json.loads(json.dumps(config, default=sorted))
    return loaded


def adapter(policy: HFPolicy) -> Adapter:
    """The policy's adapter as engines take it: peft's config and whole tensors under
    adapter_model.safetensors' names. Unsharded, the tensors are live (detached)
    references that change as training goes on: an engine copies what it keeps. Sharded
    (FSDP), each is gathered: every rank calls this together."""
    tensors = {PREFIX + name: _whole(t) for name, t in adapter_state(policy).items()}
    return Adapter(config=adapter_config(policy), tensors=tensors)


def saved_adapter(source: Path, settings: LoraSettings, state: dict[str, Tensor]) -> Adapter:
    """The adapter of a checkpoint (:func:`adapter_state`'s tensors, with the settings
    and base model directory it records) as engines take it."""
    tensors = {PREFIX + name: tensor for name, tensor in state.items()}
    return Adapter(config=_adapter_config(source, settings), tensors=tensors)


def _whole(tensor: Tensor) -> Tensor:
    """A tensor FSDP sharded gathered whole (a collective); any other as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def save_adapter(policy: HFPolicy, out: Path) -> Path:
    """Write the policy's adapter as a peft adapter directory (:func:`write_adapter`);
    a sharded policy's ranks call :func:`adapter` together and one writes it."""
    return write_adapter(adapter(policy), out)


def write_adapter(current: Adapter, out: Path) -> Path:
    """Write ``current`` as a peft adapter directory (adapter_config.json and
    adapter_model.safetensors), which ``PeftModel.from_pretrained`` and vLLM's
    ``LoRARequest`` load; written beside ``out`` and renamed, so never half written."""
    from safetensors.torch import save_file

    if out.exists():
        raise ConfigError(f"{out}: exists; the adapter is written to a new directory")
    tensors = {name: t.detach().cpu().contiguous().clone() for name, t in current.tensors.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        (Path(tmp) / CONFIG_FILE).write_text(json.dumps(current.config, indent=2, sort_keys=True))
        save_file(tensors, str(Path(tmp) / WEIGHTS_FILE), metadata={"format": "pt"})
        Path(tmp).rename(out)
    return out


# ---- merged: base plus adapter as plain weights


def merged_items(policy: HFPolicy) -> Iterator[tuple[str, Tensor]]:
    """The model's state dict under its own names (no adapters, no ``base_layer.``),
    each adapted weight as W + alpha / r * B @ A, one whole tensor at a time; the policy
    is not changed (new tensors for the adapted weights, detached live ones for the
    rest). Sharded (FSDP), each is gathered as it comes: every rank iterates together."""
    deltas = _adapted_layers(policy.model)
    for name, tensor in policy.model.state_dict().items():
        if _is_adapter(name):
            continue
        plain = name.replace(".base_layer.", ".")
        layer = deltas.get(plain.rsplit(".", 1)[0]) if name.endswith(".weight") else None
        if layer is None:
            yield plain, _whole(tensor)
        else:
            with torch.no_grad():
                yield plain, _whole(tensor + layer.get_delta_weight(ADAPTER).to(tensor.dtype))


def merged_weights(policy: HFPolicy) -> dict[str, Tensor]:
    """:func:`merged_items` as one state dict: what an engine that takes no adapters
    loads, or a ``save_pretrained`` export."""
    return dict(merged_items(policy))


def _adapted_layers(model: nn.Module) -> dict[str, Any]:
    """The peft LoRA layers by their module path, with the adapter active."""
    from peft.tuners.lora import LoraLayer

    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer) and ADAPTER in module.active_adapters
    }
