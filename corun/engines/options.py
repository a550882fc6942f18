"""The settings of the rollout engines: ``[trainer.engine_options]``, and a vLLM
engine's (those options and the model directory)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

WHERE = "trainer.engine_options"
OPTIONS = f"$.{WHERE}.options"  # where EngineOptions.options come from
DEADLINES = ("start_timeout_s", "request_timeout_s", "shutdown_timeout_s")  # every engine's


class EngineOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[trainer.engine_options]``: settings of both vLLM engines; the deadlines
    (``*_timeout_s``) bound every engine, the "local" one too (corun/engines/start.py)."""

    # Prompt + completion tokens; vLLM sizes its buffers by it (default: the model's).
    max_model_len: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # VLLM_CPU_KVCACHE_SPACE: the KV cache's memory on CPU, GiB.
    kv_cache_gib: Annotated[int, msgspec.Meta(ge=1)] = 1
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1)] = 256  # sequences batched at once
    seed: int = 0  # vLLM's own seed (every request also carries its own)
    # More vllm.LLM keyword arguments (in process) or api_server flags (server: the key
    # with "-" for "_"), e.g. {enable_prefix_caching = false}; a wrong one is exit 2.
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    # Deadlines (every engine): the start (build, warm-up, first weight load), each call
    # (a generation, a weight update; the server's every HTTP call), and the shutdown.
    # Past one the run fails with one line and the engine is given up on.
    start_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    request_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    shutdown_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 20.0


class VLLMConfig(EngineOptions, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """An engine's settings and its model: a Hugging Face directory (config.json,
    safetensors, tokenizer)."""

    model: str
