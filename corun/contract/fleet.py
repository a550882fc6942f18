"""The wire form of a rollout engine served over HTTP to a training run on another
machine (``corun engine serve``: corun/serve/engine_server.py; the trainer's side, a
fleet of them: corun/engines/fleet.py). JSON for the calls, safetensors for weights.

- ``GET /health`` → :class:`Health` (the version it serves);
- ``POST /generate`` :class:`GenerateRequest` → :class:`GenerateReply`;
- ``POST /weights/{version}/bucket`` a safetensors body (:func:`pack`) → staged;
- ``POST /weights/{version}/commit`` :class:`Commit` → every staged tensor loaded as
  ``version`` (the engine's own ``update_weights``), or 409 when tensors are missing;
- ``GET /fingerprint`` → :class:`Fingerprint`, computed by the engine from its copy;
- ``POST /weight_transfer/{step}`` (a member whose vLLM runs on CUDA, ``Health.transfer``
  "nccl"): vLLM's weight-transfer calls (:data:`TRANSFER_STEPS`, the bodies of vLLM's
  own HTTP routes), the weights going GPU to GPU over NCCL beside the HTTP calls.

A sync streams the state dict in buckets of bounded size (one bucket in memory on
either side at a time, besides the staged tensors), so a model of any size travels
over plain HTTP between CPU machines. Refusals are 4xx with ``{"error": message}``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict

import msgspec
from torch import Tensor

from corun.contract.engine import Finish, Generation, Sampling


class WireSampling(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_ids: list[int] = msgspec.field(default_factory=list)
    top_logprobs: int = 0
    top_k: int = 0

    def sampling(self) -> Sampling:
        fields = msgspec.structs.asdict(self)
        return Sampling(**{**fields, "stop_ids": tuple(self.stop_ids)})

    @classmethod
    def of(cls, sampling: Sampling) -> WireSampling:
        return cls(**{**asdict(sampling), "stop_ids": list(sampling.stop_ids)})


class GenerateRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prompts: list[list[int]]
    sampling: WireSampling
    seed: int


class WireGeneration(msgspec.Struct, frozen=True):
    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish: Finish
    top: list[list[tuple[int, float]]] | None = None

    def generation(self) -> Generation:
        return Generation(self.ids, self.logprobs, self.versions, self.finish, self.top)

    @classmethod
    def of(cls, g: Generation) -> WireGeneration:
        return cls(g.ids, g.logprobs, g.versions, g.finish, g.top)


class GenerateReply(msgspec.Struct, frozen=True):
    generations: list[WireGeneration]


class ScoreRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``/score``: each completion's tokens scored after its prompt (a teacher's)."""

    prompts: list[list[int]]
    completions: list[list[int]]


class ScoreReply(msgspec.Struct, frozen=True):
    scores: list[list[float]]


class Health(msgspec.Struct, frozen=True):
    version: int
    # "nccl": the member also takes weights through vLLM's weight-transfer API from a
    # trainer's GPU, into ``workers`` GPU workers, in ``dtype``; "": buckets only.
    transfer: str = ""
    workers: int = 1
    dtype: str = ""
    # Its engine takes full-weight updates in flight (its config's
    # trainer.inflight_at_sync = "interrupt"): running generations are not drained.
    interrupts: bool = False


# vLLM's weight-transfer calls in their order (init once per trainer; start, update,
# finish per sync), as ``POST /weight_transfer/{step}``.
TRANSFER_STEPS = (
    "init_weight_transfer_engine", "start_weight_update", "update_weights",
    "finish_weight_update", "shutdown_weight_transfer_engine",
)  # fmt: skip


class Commit(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tensors: int  # how many the buckets of this version held


class Fingerprint(msgspec.Struct, frozen=True):
    fingerprint: str


def buckets(state: Mapping[str, Tensor], limit_bytes: int) -> Iterator[dict[str, Tensor]]:
    """``state`` in groups of at most ``limit_bytes`` (a larger tensor goes alone)."""
    bucket: dict[str, Tensor] = {}
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = tensor
        size += nbytes
    if bucket:
        yield bucket


def pack(tensors: Mapping[str, Tensor]) -> bytes:
    """A bucket as safetensors bytes (CPU, contiguous; tied tensors each their own)."""
    from safetensors.torch import save

    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        t = tensor.detach().to("cpu").contiguous()
        if t.data_ptr() in seen:  # safetensors refuses shared storage
            t = t.clone()
        seen.add(t.data_ptr())
        out[name] = t
    return bytes(save(out))


def unpack(data: bytes) -> dict[str, Tensor]:
    """A bucket back; a damaged one raises ``ValueError`` naming why."""
    from safetensors.torch import load

    try:
        return dict(load(data))
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"not a safetensors bucket ({exc})") from None
