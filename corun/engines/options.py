"""The settings of the rollout engines: ``[trainer.engine_options]``, and a vLLM
engine's (those options and the model directory); the per-device defaults of the
engine's precision and graph mode (:func:`resolved_dtype`, :func:`engine_dtype`,
:func:`eager`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

if TYPE_CHECKING:
    import torch

WHERE = "trainer.engine_options"
OPTIONS = f"$.{WHERE}.options"  # where EngineOptions.options come from
DEADLINES = ("start_timeout_s", "request_timeout_s", "shutdown_timeout_s")  # every engine's
LOCAL = (
    *DEADLINES,
    "dtype",
    "lora_rank",
    "max_loras",
    "max_num_seqs",
    "share_weights",
)  # what the "local" engine takes too
FLEET = ("urls", "bucket_mb", "token")  # the "remote" engine's alone
REMOTE = (*DEADLINES, "dtype", *FLEET)  # what it takes (dtype: its servers' precision)

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Precision = Literal["float32", "bfloat16", "float16"]


class EngineOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[trainer.engine_options]``: settings of both vLLM engines; the deadlines
    (``*_timeout_s``) bound every engine, the "local" one too (corun/engines/start.py),
    which also keeps its weights in ``dtype`` and takes LoRA adapters."""

    # Prompt + completion tokens; vLLM sizes its buffers by it (default: the model's).
    max_model_len: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # VLLM_CPU_KVCACHE_SPACE: the KV cache's memory on CPU, GiB.
    kv_cache_gib: Annotated[int, msgspec.Meta(ge=1)] = 1
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1)] = 256  # sequences batched at once
    # On a GPU: the share of its memory vLLM may take (weights, activations, KV cache);
    # unset: vLLM's 0.9 on GPUs of its own (devices), else 0.3 (the trainer's GPU).
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    # "vllm": the engine shares the trainer's GPU, and sleeps (vLLM's sleep mode: its
    # memory given back) while the trainer steps: sleep → train → sync → wake, each a
    # phase of the template. Only at loop.concurrency = 1 (generation and training
    # alternate). On CPU the phases run and vLLM's sleep does nothing.
    colocate: bool = False
    # "local": sample from the policy's own parameters where nothing can read them
    # mid-update (loop.concurrency = 1 with no server beside the run, one process, the
    # engine's precision, no LoRA): one copy of the weights less. False: always a copy
    # of its own, as vLLM and a fleet member hold — the same samples as theirs bit for
    # bit (a shared tensor's memory layout can round a matmul differently).
    share_weights: bool = True
    # "vllm-server": the GPUs of this node the server runs on (CUDA_VISIBLE_DEVICES;
    # tensor parallel over them), apart from the trainer's; weight syncs go device to
    # device through vLLM's weight-transfer API (NCCL; CUDA IPC on the trainer's GPU).
    devices: list[Annotated[int, msgspec.Meta(ge=0)]] = msgspec.field(default_factory=list)
    seed: int = 0  # vLLM's own seed (every request also carries its own)
    # The precision of the engine's weights (the trainer keeps float32 master weights):
    # "auto" is bfloat16 where CUDA is available, float32 on CPU (resolved_dtype).
    dtype: Dtype = "auto"
    # vLLM: eager PyTorch (true) or captured CUDA graphs (false); unset: eager on CPU,
    # graphs on GPU (eager).
    enforce_eager: bool | None = None
    # LoRA, set by the trainer from [trainer.lora]: the adapters' rank (unset: no LoRA;
    # vLLM is then built without LoRA support), and how many adapter versions vLLM keeps
    # loaded — at least loop.max_staleness + 1, so every generation still running
    # finishes on the adapter it started with.
    lora_rank: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_loras: Annotated[int, msgspec.Meta(ge=1)] = 2
    # "remote": the fleet's engine servers (`corun engine serve`), their base URLs; a
    # sync streams the weights to each in buckets of bucket_mb; token: the servers'
    # serve.token ("env:NAME" reads $NAME).
    urls: list[str] = msgspec.field(default_factory=list)
    bucket_mb: Annotated[int, msgspec.Meta(ge=1)] = 64
    token: str = ""
    # vLLM under trainer.inflight_at_sync = "interrupt": what a running request's KV
    # cache does when the weights change under it. "keep": it stays, computed by the
    # older weights (as PipelineRL; vLLM runs without prefix caching, so no new request
    # reuses old KV either); "recompute": every running request is preempted and its
    # prompt and tokens so far prefilled again under the new weights.
    kv_at_switch: Literal["keep", "recompute"] = "keep"
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
    # Set by corun (engines/start.py), not a setting: how a server on GPUs of its own
    # takes the trained weights (weight_transfer.py); None: from a file.
    weight_transfer: Literal["nccl", "ipc"] | None = None
    own_gpus: bool = False  # set by corun: on devices that are not the trainer's
    # Set by corun: an engine that scores given tokens and samples nothing (a
    # distillation teacher's): vLLM reports raw log-probs (temperature 1), prompts' too.
    scores_only: bool = False
    # Set by corun (trainer.inflight_at_sync = "interrupt"): a full-weight update goes
    # in flight, between two decode steps, instead of draining running generations.
    interrupt: bool = False

    @property
    def workers(self) -> int:
        """The server's GPU workers: tensor parallel over its devices."""
        return int(self.options.get("tensor_parallel_size", len(self.devices) or 1))


def on_gpu() -> bool:
    """Whether vLLM runs on a GPU here (CUDA available), which sets its defaults."""
    import torch

    return bool(torch.cuda.is_available())


def memory_share(config: VLLMConfig) -> float:
    """vLLM's ``gpu_memory_utilization``: as set, else vLLM's own 0.9 on GPUs of its
    own, and 0.3 on the trainer's GPU (in process, or a server there): the trainer's
    weights, optimizer state and activations need the rest."""
    if config.gpu_memory_utilization is not None:
        return config.gpu_memory_utilization
    return 0.9 if config.own_gpus else 0.3


def resolved_dtype(options: EngineOptions) -> Precision:
    """The engine's precision: ``options.dtype``, with "auto" resolved by the device.

    bfloat16 on a GPU: half the memory and bandwidth of float32 at full tensor-core
    speed, and float32's exponent range, so sampling needs no loss-scaling tricks; the
    trainer's float32 master weights are rounded to it at each sync (fingerprints
    compare them rounded: :func:`engine_dtype`). float32 on CPU: CPUs gain little from
    bfloat16 (vLLM's CPU bfloat16 kernels need AVX512-BF16 or AMX), and float32 keeps
    the behaviour log-probs equal to the trainer's float32 recomputation (within 1e-6,
    measured on the tiny model in vLLM; up to 5e-3 apart in bfloat16), which is what
    the CPU tests check.
    """
    if options.dtype != "auto":
        return options.dtype
    return "bfloat16" if on_gpu() else "float32"


def engine_dtype(options: EngineOptions) -> torch.dtype:
    """The torch dtype of the engine's floating-point weights: what a fingerprint of
    the trained state rounds to (``weights_fingerprint(state, dtype=...)``) so that it
    equals the engine's, which holds the weights in this precision."""
    import torch

    dtype: torch.dtype = getattr(torch, resolved_dtype(options))
    return dtype


def eager(options: EngineOptions) -> bool:
    """vLLM's ``enforce_eager``: as set, else eager on CPU (vLLM's CPU graph mode is
    torch.compile, minutes of compiling for a small gain) and CUDA graphs on a GPU (a
    decode step is many small kernels: graphs launch them at once)."""
    if options.enforce_eager is not None:
        return options.enforce_eager
    return not on_gpu()
