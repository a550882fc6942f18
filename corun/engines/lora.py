"""LoRA adapters on the engine side of ``[trainer.lora]``: the names of an adapter's
tensors in a model with peft's layers injected, an adapter written as ``peft`` saves
one (what vLLM loads), and whether an engine takes adapters at all.

An :class:`corun.contract.engine.Adapter` names its tensors as adapter_model.safetensors
does (``base_model.model.<module>.lora_A.weight``); a model into which
``peft.inject_adapter_in_model`` put its layers (adapter "default") holds them as
``<module>.lora_A.default.weight``, and its base weights as
``<module>.base_layer.weight``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from corun.contract.engine import Adapter, AdapterEngine, Engine, EngineError

ADAPTER = "default"  # the adapter name of peft's injected layers
PREFIX = "base_model.model."  # adapter_model.safetensors' names start with it
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def parameter_name(name: str) -> str:
    """``base_model.model.X.lora_A.weight`` -> ``X.lora_A.default.weight`` (the adapter
    name goes after the first ``lora_*`` part: lora_A, lora_B, lora_embedding_A, ...).
    A name not of that form is a ValueError."""
    parts = name.removeprefix(PREFIX).split(".")
    for i, part in enumerate(parts):
        if part.startswith("lora_"):
            return ".".join([*parts[: i + 1], ADAPTER, *parts[i + 1 :]])
    raise ValueError(f"{name!r} is not a LoRA tensor's name (no lora_* part)")


def adapter_parameters(names: Iterable[str]) -> set[str]:
    """Of a model's parameter names, those of peft's injected adapter."""
    out = set()
    for name in names:
        parts = name.split(".")
        if any(
            part.startswith("lora_") and parts[i + 1 : i + 2] == [ADAPTER]
            for i, part in enumerate(parts)
        ):
            out.add(name)
    return out


def base_weights(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A state dict with peft's layers injected as the base model's: the adapter's
    parameters left out, ``X.base_layer.weight`` named ``X.weight`` again (what vLLM
    loads). A state without injected layers comes back as it is."""
    adapter = adapter_parameters(state)
    if not adapter:
        return dict(state)
    return {
        name.replace(".base_layer.", "."): tensor
        for name, tensor in state.items()
        if name not in adapter
    }


def write_adapter(adapter: Adapter, directory: Path) -> None:
    """``adapter`` as ``peft``'s ``save_pretrained`` writes one, into ``directory``
    (created): adapter_config.json and adapter_model.safetensors, on CPU."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: tensor.detach().to("cpu").contiguous().clone()  # no shared storage
        for name, tensor in adapter.tensors.items()
    }
    save_file(tensors, str(directory / WEIGHTS_FILE))
    text = json.dumps(dict(adapter.config), default=_jsonable, indent=2, sort_keys=True)
    (directory / CONFIG_FILE).write_text(text)


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset):  # peft's target_modules may be a set
        return sorted(value)
    raise TypeError(f"adapter_config.json: {type(value).__name__} is not JSON")


def require_lora(lora_rank: int | None, engine: str) -> None:
    """An adapter for a vLLM ``engine`` built without LoRA support: an EngineError."""
    if lora_rank is None:
        raise EngineError(
            f"{engine} was built without LoRA support (trainer.engine_options.lora_rank is unset)"
        )


def takes_adapters(engine: Engine) -> bool:
    """Whether ``engine`` — through its wrappers (``inner``) — takes LoRA adapters
    (``update_adapter``); one that does not needs the adapter merged into full weights."""
    inner: Any = engine
    while getattr(inner, "inner", None) is not None:
        inner = inner.inner
    return isinstance(inner, AdapterEngine)
