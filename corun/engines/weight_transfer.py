"""Weight syncs device to device for a vLLM server on GPUs of its own
(``engine_options.devices``), through vLLM's own weight-transfer API rather than a file:
NCCL from the trainer's GPU to the server's workers, or CUDA IPC handles when the server
shares the trainer's GPU (NCCL does not join two ranks on one device).

The server is started with ``--weight-transfer-config``; after its start the trainer
opens vLLM's trainer-side engine (``WeightTransferTrainerFactory.trainer_init``) with
vLLM's HTTP control client, and each sync sends the state dict through it
(``send_weights``: vLLM's start, update and finish of a layerwise reload). The tensors
go in the engine's precision, from the trainer's device. Only on CUDA: without
``devices`` (and always on CPU) the server engine reloads from a safetensors file
(vllm_server.py). What runs here is vLLM's tested code; corun adds the choice of
backend, the state as a ``WeightSource`` and the order of the calls.

A fleet member on CUDA (``corun engine serve``, corun/engines/fleet.py) takes weights
the same way: vLLM's calls go to the member's ``/weight_transfer/{step}`` routes
(:class:`FleetSyncClient`), and the member's workers join an NCCL group whose rank 0
is the trainer, at the trainer's address as the member's network reaches it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from corun.execution.procs import free_port

Backend = Literal["nccl", "ipc"]


def backend_for(devices: Sequence[int], trainer: torch.device) -> Backend | None:
    """How the server on ``devices`` receives weights from a trainer on ``trainer``:
    None (a file) unless both are on CUDA."""
    if not devices or trainer.type != "cuda":
        return None
    return "ipc" if trainer.index in devices else "nccl"


def server_flags(backend: Backend) -> list[str]:
    return ["--weight-transfer-config", json.dumps({"backend": backend})]


def server_env(backend: Backend) -> dict[str, str]:
    # IPC handles travel pickled over HTTP: the server must accept them.
    return {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if backend == "ipc" else {}


class DeviceTransfer:
    """vLLM's trainer-side transfer engine for one server (blocking calls: run them
    off the event loop). ``workers``: the server's GPU workers (its tensor parallel)."""

    def __init__(
        self, url: str, backend: Backend, workers: int, dtype: torch.dtype,
        client: Any = None, address: str = "127.0.0.1",
    ) -> None:  # fmt: skip
        """``client``: how vLLM's calls reach the engine (default: a vLLM server's own
        routes at ``url``); ``address``: the trainer's, as the engine reaches it."""
        self.url, self.backend, self.workers, self.dtype = url, backend, workers, dtype
        self.client, self.address = client, address
        self.source = _StateSource()
        self.engine: Any = None

    def open(self) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        info: Any
        if self.backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info = NCCLTrainerInitInfo(
                master_address=self.address, master_port=free_port(),
                world_size=1 + self.workers, rank=0,
            )  # fmt: skip
        else:
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            info = IPCTrainerInitInfo(rank=0)
        client = self.client or HTTPVLLMWeightSyncClient(self.url)
        self.engine = WeightTransferTrainerFactory.trainer_init(
            info, client=client, source=self.source.wrapped()
        )

    def send(self, state: Mapping[str, Tensor]) -> None:
        """Every tensor of ``state`` into the server's model (its names: the model's)."""
        self.source.state = {
            name: t.detach().to(self.dtype).contiguous() for name, t in state.items()
        }
        try:
            self.engine.send_weights()
        finally:
            self.source.state = {}

    def close(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.shutdown()


class FleetSyncClient:
    """vLLM's weight-sync client protocol over a fleet member's ``/weight_transfer``
    routes (corun/serve/engine_server.py); ``version`` is what the member serves after
    the update it finishes. Blocking: runs on the sync's worker thread."""

    def __init__(self, url: str, headers: dict[str, str], timeout_s: float) -> None:
        self.url, self.headers, self.timeout_s = url, headers, timeout_s
        self.version = -1

    def _post(self, step: str, body: dict[str, Any] | None = None) -> None:
        import httpx

        response = httpx.post(
            f"{self.url}/weight_transfer/{step}", json=body, headers=self.headers,
            timeout=self.timeout_s,
        )  # fmt: skip
        if response.status_code >= 400:
            raise RuntimeError(f"{step}: HTTP {response.status_code}: {response.text[:300]}")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("init_weight_transfer_engine", {"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self._post("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("finish_weight_update", {"weight_version": str(self.version)})


def address_towards(url: str) -> str:
    """This machine's address on the route to ``url``'s host (what that host reaches
    this one at): a UDP socket's local end once connected, which sends nothing."""
    import socket
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])


class _StateSource:
    """The state dict of the current sync as vLLM's ``WeightSource`` (re-iterable,
    its metadata matching its iteration)."""

    def __init__(self) -> None:
        self.state: dict[str, Tensor] = {}

    def wrapped(self) -> Any:
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

        holder = self

        class Source(WeightSource):
            def metadata(self) -> list[ParamMeta]:
                return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in holder.state.items()]

            def __iter__(self) -> Iterator[tuple[str, Tensor]]:
                return iter(list(holder.state.items()))

        return Source()
