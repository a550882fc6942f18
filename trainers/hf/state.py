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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from corun import CheckpointError, ConfigError
from corun.records.checkpoint import latest, read
from corun.records.prerequisites import checkpoint_for
from trainers.hf.policy import HFPolicy, load_policy, quiet_transformers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def hf_state(policy: HFPolicy, optimizer: torch.optim.Optimizer, **extra: Any) -> dict[str, Any]:
    """A trainer's resumable state around an HF policy (live tensors: the runtime
    snapshots them)."""
    return {
        "model": policy.weights(),
        "optimizer": optimizer.state_dict(),
        "model_config": policy.config_json(),
        "model_source": str(policy.source),
        **extra,
    }


def load_hf_state(
    state: dict[str, Any], policy: HFPolicy, optimizer: torch.optim.Optimizer
) -> None:
    """Restore :func:`hf_state`; a checkpoint of another model is refused."""
    check_same_model(state, policy, "checkpoint")
    policy.model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def check_same_model(state: dict[str, Any], policy: HFPolicy, what: str) -> None:
    saved = json.loads(state.get("model_config", "{}"))
    ours = json.loads(policy.config_json())
    if saved != ours:
        differ = sorted(k for k in saved.keys() | ours.keys() if saved.get(k) != ours.get(k))
        raise CheckpointError(
            f"the {what} is of another model than {policy.source} (config differs in "
            f"{', '.join(differ[:4])})"
        )


def load_model(spec: str, init_from: str, where: str) -> tuple[HFPolicy, PreTrainedTokenizerBase]:
    """The model of ``spec`` (``hf:<dir>``), with the weights of the checkpoint
    ``init_from`` names (a directory, or a run's config) when given."""
    policy, tokenizer = load_policy(spec, where)
    if init_from:
        path = checkpoint_for(init_from)
        _, tensors = read(path)
        state = tensors.get("trainer", {})
        if "model_config" not in state or not isinstance(state["model_config"], str):
            raise CheckpointError(f"{path}: not a checkpoint of an hf: policy")
        check_same_model(state, policy, f"warm start {path}")
        policy.model.load_state_dict(state["model"])
    return policy, tokenizer


def export(checkpoint: str, out: Path) -> Path:
    """A checkpoint's HF policy as a ``save_pretrained`` directory: weights
    (safetensors), config, and the source directory's tokenizer files."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    newest = latest(Path(checkpoint)) if Path(checkpoint).is_dir() else None
    path = newest or checkpoint_for(checkpoint)
    _, tensors = read(path)
    state = tensors.get("trainer", {})
    if not isinstance(state.get("model_config"), str):
        raise CheckpointError(f"{path}: not a checkpoint of an hf: policy")
    source = Path(state["model_source"])
    saved = json.loads(state["model_config"])
    config = AutoConfig.for_model(saved.pop("model_type"), **saved)
    # Built on the CPU, not the meta device: non-persistent buffers (rotary
    # frequencies) are computed at init and are not in the state dict.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state["model"])
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
