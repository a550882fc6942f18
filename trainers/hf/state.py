"""An HF policy in checkpoints: the trainer state it saves, restoring it, warm starts
from another run's checkpoint, and export back to a ``save_pretrained`` directory
(``python -m trainers.hf.export``).

The state holds the weights under the model's own names, the model's config as JSON
and the source directory (for its tokenizer), so a checkpoint names what it is a
checkpoint of.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from torch import Tensor, nn

from corun import CheckpointError, ConfigError
from corun.records.checkpoint import latest, read_whole
from corun.records.prerequisites import checkpoint_for
from trainers.hf.lora import (
    LoraSettings,
    adapter_state,
    is_lora,
    load_adapter_state,
    lora_settings,
)
from trainers.hf.policy import HFPolicy, load_policy, quiet_transformers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def hf_state(
    policy: HFPolicy, optimizer: torch.optim.Optimizer | None,
    modules: Mapping[str, nn.Module] = {}, **extra: Any,
) -> dict[str, Any]:  # fmt: skip
    """A trainer's resumable state around an HF policy and the ``modules`` trained beside
    it (live tensors: the runtime snapshots them). The weights are the trained ones:
    the adapters only under LoRA. Optimizer state is keyed by parameter name, and,
    like the weights of a sharded policy, holds each rank's shards; ``optimizer`` None:
    an empty one, which :func:`load_hf_state` restores as a fresh optimizer."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    weights = adapter_state(policy) if is_lora(policy) else policy.weights()
    empty: dict[str, Any] = {"state": {}, "param_groups": []}
    return {
        "model": weights,
        "optimizer": empty
        if optimizer is None
        else get_optimizer_state_dict(_trained(policy, modules), optimizer),
        "model_config": policy.config_json(),
        "model_source": str(policy.source),
        # Under LoRA: its settings (JSON), and the checkpoint its base weights came from
        # ("" for the source directory's), so the whole model can be rebuilt.
        "lora": _settings_json(policy),
        "base_checkpoint": policy.__dict__.get("base_checkpoint", ""),
        **extra,
    }


def load_hf_state(
    state: dict[str, Any], policy: HFPolicy, optimizer: torch.optim.Optimizer,
    modules: Mapping[str, nn.Module] = {},
) -> None:  # fmt: skip
    """Restore :func:`hf_state`; a checkpoint of another model, or with adapters where
    the run has none (or the other way), is refused. The saved tensors are copied into
    the policy's parameters, and the optimizer's state is moved to theirs, so a
    checkpoint saved on another device resumes on this run's."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    check_same_model(state, policy, "checkpoint")
    if bool(state.get("lora", False)) != is_lora(policy):
        saved = "LoRA adapters" if state.get("lora") else "full weights"
        raise CheckpointError(
            f"the checkpoint holds {saved}; this run's [trainer.lora] says otherwise"
        )
    if is_lora(policy):
        load_adapter_state(policy, state["model"])
    else:
        policy.model.load_state_dict(state["model"])
    saved_optimizer = state["optimizer"]
    if not saved_optimizer.get("state"):
        # Saved without state (hf_state's None): a fresh optimizer. torch's
        # set_optimizer_state_dict would first make a state by a step on zero
        # gradients, which counts: Adam's bias correction would start one step on.
        optimizer.state.clear()
        return
    if any(isinstance(key, int) for key in saved_optimizer.get("state", {})):
        optimizer.load_state_dict(saved_optimizer)  # format 3: keyed by position
    else:
        set_optimizer_state_dict(_trained(policy, modules), optimizer, saved_optimizer)


def _settings_json(policy: HFPolicy) -> str:
    settings = lora_settings(policy)
    return "" if settings is None else msgspec.json.encode(settings).decode()


def _trained(policy: HFPolicy, modules: Mapping[str, nn.Module]) -> nn.Module:
    """One module holding every trained parameter, which names them for the optimizer's
    state: the policy's under ``policy.``, each module's under its name."""
    return nn.ModuleDict({"policy": policy, **modules})


def check_same_model(state: dict[str, Any], policy: HFPolicy, what: str) -> None:
    saved = json.loads(state.get("model_config", "{}"))
    ours = json.loads(policy.config_json())
    if saved != ours:
        differ = sorted(k for k in saved.keys() | ours.keys() if saved.get(k) != ours.get(k))
        raise CheckpointError(
            f"the {what} is of another model than {policy.source} (config differs in "
            f"{', '.join(differ[:4])})"
        )


def load_model(
    spec: str, init_from: str, where: str, device: torch.device | str = "cpu"
) -> tuple[HFPolicy, PreTrainedTokenizerBase]:
    """The model of ``spec`` (``hf:<dir>``), with the weights of the checkpoint
    ``init_from`` names (a directory, or a run's config) when given, on ``device`` (the
    run's: loaded on the CPU, then moved once)."""
    policy, tokenizer = load_policy(spec, where)
    if init_from:
        path = checkpoint_for(init_from)
        _, tensors = read_whole(path)
        state = tensors.get("trainer", {})
        if "model_config" not in state or not isinstance(state["model_config"], str):
            raise CheckpointError(f"{path}: not a checkpoint of an hf: policy")
        check_same_model(state, policy, f"warm start {path}")
        policy.model.load_state_dict(whole_weights(state, path))
        policy.base_checkpoint = str(path)  # type: ignore[assignment]  # see hf_state
    return policy.to(device), tokenizer


def whole_weights(state: dict[str, Any], path: Path) -> dict[str, Tensor]:
    """The model's whole weights in a checkpoint's trainer state: as saved, or, from a
    LoRA run, its base weights with the adapters merged in (W + alpha / r · B A)."""
    if not state.get("lora"):
        return dict(state["model"])
    settings = msgspec.json.decode(state["lora"], type=LoraSettings)
    weights = _base_weights(state, path)
    scale = settings.alpha / settings.rank
    for name, down in state["model"].items():
        if ".lora_A." not in name:
            continue
        module = name.split(".lora_A.")[0]
        up = state["model"][f"{module}.lora_B.weight"]
        weights[f"{module}.weight"] = weights[f"{module}.weight"] + scale * (up @ down)
    return weights


def _base_weights(state: dict[str, Any], path: Path) -> dict[str, Tensor]:
    """The weights a LoRA run's adapters were trained on."""
    base = state.get("base_checkpoint", "")
    if base:
        _, tensors = read_whole(Path(base))
        return whole_weights(tensors["trainer"], Path(base))
    try:
        policy, _ = load_policy(f"hf:{state['model_source']}", f"{path}: its base model")
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    return dict(policy.model.state_dict())


def export(checkpoint: str, out: Path) -> Path:
    """A checkpoint's HF policy as a ``save_pretrained`` directory: weights
    (safetensors), config, and the source directory's tokenizer files."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    newest = latest(Path(checkpoint)) if Path(checkpoint).is_dir() else None
    path = newest or checkpoint_for(checkpoint)
    _, tensors = read_whole(path)
    state = tensors.get("trainer", {})
    if not isinstance(state.get("model_config"), str):
        raise CheckpointError(f"{path}: not a checkpoint of an hf: policy")
    source = Path(state["model_source"])
    saved = json.loads(state["model_config"])
    config = AutoConfig.for_model(saved.pop("model_type"), **saved)
    # Built on the CPU, not the meta device: non-persistent buffers (rotary
    # frequencies) are computed at init and are not in the state dict.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(whole_weights(state, path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as exc:
        raise ConfigError(f"{source}: the model's source directory is unreadable ({exc})") from None
    if out.exists():
        raise ConfigError(f"{out}: exists; export writes a new directory")
    # Written beside ``out`` and renamed: an interrupted export leaves no half model.
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        Path(tmp).rename(out)
    return out
