"""A fleet member whose vLLM runs on CUDA takes weights GPU to GPU through vLLM's
weight-transfer API (corun/engines/weight_transfer.py), driven by the trainer over the
member's ``/weight_transfer/{step}`` routes. NCCL itself needs two GPUs; what runs here
is everything around it: the member's routes and its engine's steps in vLLM's order,
the trainer's choice of NCCL or buckets per member, the version a finished transfer
sets, a member whose transfer fails dropped, and the refusals. And, with members in
this process: every member gone between a sync and its fingerprint.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import anyio
import httpx
import pytest
import torch
from torch import Tensor

from corun.base.config import ServeConfig
from corun.contract.engine import (
    EngineError,
    Generation,
    Sampling,
    TransferEngine,
    TransferTarget,
)
from corun.contract.fleet import TRANSFER_STEPS
from corun.engines import fleet as fleet_module
from corun.engines.fleet import FleetEngine
from corun.engines.weight_transfer import FleetSyncClient, address_towards
from corun.execution.compute import Lane
from corun.serve.engine_server import EngineServer

STATE = {"w": torch.ones(4, 2), "b": torch.zeros(3)}


class BucketEngine:
    """A member's engine that takes weights in buckets only (as on CPU)."""

    interrupts = False

    def __init__(self) -> None:
        self.version = 0
        self.steps: list[tuple[str, dict[str, Any]]] = []
        self.loaded: list[int] = []

    async def generate(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int
    ) -> list[Generation]:
        return [Generation([1], [0.0], [self.version], "length") for _ in prompts]

    async def update_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        self.loaded.append(version)
        self.version = version

    async def fingerprint(self) -> str:
        return f"v{self.version}"

    async def pause(self) -> None: ...
    async def resume(self) -> None: ...

    async def health(self) -> bool:
        return True

    async def shutdown(self) -> None: ...


class NCCLEngine(BucketEngine):
    """A member's vLLM on CUDA, as far as its routes see it: each step recorded."""

    fail_at = ""

    def transfer_target(self) -> TransferTarget | None:
        return TransferTarget("nccl", 2, "bfloat16")

    async def transfer_step(self, step: str, body: dict[str, Any]) -> None:
        if step == self.fail_at:
            raise EngineError(f"vLLM weight transfer ({step}) failed: NCCL timeout")
        self.steps.append((step, body))
        if step == "finish_weight_update":
            self.version = int(body["weight_version"])


class FakeLink:
    """vLLM's trainer-side NCCL engine, minus NCCL: the same client calls in vLLM's
    order (NCCLTrainerWeightTransferEngine.trainer_init and send_weights)."""

    opened: ClassVar[list[FakeLink]] = []

    def __init__(
        self, url: str, backend: str, workers: int, dtype: torch.dtype, client: Any,
        address: str,
    ) -> None:  # fmt: skip
        self.workers, self.dtype, self.client, self.address = workers, dtype, client, address
        self.sent: list[dict[str, Tensor]] = []
        self.closed = False

    def open(self) -> None:
        info = {"master_address": self.address, "rank_offset": 1, "world_size": 1 + self.workers}
        self.client.init_weight_transfer_engine(info)
        FakeLink.opened.append(self)

    def send(self, state: Mapping[str, Tensor]) -> None:
        self.client.start_weight_update()
        self.client.update_weights({"names": list(state)})
        self.sent.append(dict(state))
        self.client.finish_weight_update()

    def close(self) -> None:
        self.closed = True
        self.client.shutdown_weight_transfer_engine()


@asynccontextmanager
async def served(engine: Any) -> AsyncIterator[str]:
    server = EngineServer(engine, ServeConfig(enabled=True, fleet=True), Lane("serve"))
    async with server.running() as url:
        yield url


@pytest.fixture
def fake_links(monkeypatch: pytest.MonkeyPatch) -> list[FakeLink]:
    FakeLink.opened = []
    monkeypatch.setattr(fleet_module, "DeviceTransfer", FakeLink)
    return FakeLink.opened


def _fleet(urls: list[str], device: str) -> FleetEngine:
    return FleetEngine(
        urls, request_timeout_s=10, fleet_timeout_s=5, bucket_mb=1, device=torch.device(device)
    )


@pytest.mark.anyio
async def test_a_trainer_on_cuda_syncs_an_nccl_member_through_vllms_steps(
    fake_links: list[FakeLink],
) -> None:
    member, plain = NCCLEngine(), BucketEngine()
    with anyio.fail_after(30):
        async with served(member) as url, served(plain) as plain_url:
            fleet = await FleetEngine.connect(
                [url, plain_url], request_timeout_s=10, fleet_timeout_s=5, bucket_mb=1,
                device=torch.device("cuda"),  # a device object only: nothing runs on it
            )  # fmt: skip
            assert isinstance(member, TransferEngine)
            for version in (1, 2):
                await fleet.update_weights(STATE, version)
            async with httpx.AsyncClient() as http:
                health = (await http.get(url + "/health")).json()
            await fleet.shutdown()
    assert [s for s, _ in member.steps] == [
        "init_weight_transfer_engine",
        *["start_weight_update", "update_weights", "finish_weight_update"] * 2,
        "shutdown_weight_transfer_engine",
    ]
    assert member.loaded == [] and plain.loaded == [1, 2]  # no buckets to the NCCL member
    assert member.version == plain.version == 2
    assert member.steps[0][1]["init_info"]["world_size"] == 3  # the trainer and 2 workers
    (link,) = fake_links
    assert link.dtype == torch.bfloat16 and link.workers == 2 and link.closed
    assert link.address == "127.0.0.1"  # this machine, as the member's route reaches it
    assert health == {
        "version": 2,
        "transfer": "nccl",
        "workers": 2,
        "dtype": "bfloat16",
        "interrupts": False,
    }
    assert fleet.sync_bytes == 11 * 2 + len(_packed())  # bf16 over NCCL, a bucket over HTTP


def _packed() -> bytes:
    from corun.contract.fleet import pack

    return pack(STATE)


@pytest.mark.anyio
async def test_a_trainer_on_the_cpu_sends_buckets_to_an_nccl_member(
    fake_links: list[FakeLink],
) -> None:
    member = NCCLEngine()
    with anyio.fail_after(30):
        async with served(member) as url:
            fleet = _fleet([url], "cpu")
            await fleet.update_weights(STATE, 1)
    assert member.loaded == [1] and member.steps == [] and fake_links == []


@pytest.mark.anyio
async def test_a_member_whose_transfer_fails_is_dropped(fake_links: list[FakeLink]) -> None:
    failing, other = NCCLEngine(), NCCLEngine()
    failing.fail_at = "update_weights"
    with anyio.fail_after(30):
        async with served(failing) as bad_url, served(other) as url:
            fleet = await FleetEngine.connect(
                [bad_url, url], request_timeout_s=10, fleet_timeout_s=5, bucket_mb=1,
                device=torch.device("cuda"),
            )  # fmt: skip
            await fleet.update_weights(STATE, 1)
    assert [m.live for m in fleet.members] == [False, True]
    assert fleet.counts["dropped"] == 1 and other.version == 1
    assert fake_links[0].closed  # its group is given up


@pytest.mark.anyio
async def test_the_transfer_routes_refuse_what_they_cannot_do() -> None:
    with anyio.fail_after(30):
        async with (
            served(BucketEngine()) as plain,
            served(NCCLEngine()) as nccl,
            httpx.AsyncClient() as http,
        ):
            health = (await http.get(plain + "/health")).json()
            refused = await http.post(plain + "/weight_transfer/start_weight_update")
            unknown = await http.post(nccl + "/weight_transfer/reset_weights")
            bad = await http.post(nccl + "/weight_transfer/update_weights", content=b"{no")
            ok = await http.post(nccl + "/weight_transfer/start_weight_update")
    assert health == {"version": 0, "transfer": "", "workers": 1, "dtype": "", "interrupts": False}
    assert refused.status_code == 409 and "buckets only" in refused.json()["error"]
    assert unknown.status_code == 404 and "reset_weights" in unknown.json()["error"]
    assert bad.status_code == 400 and "error" in bad.json()
    assert ok.status_code == 200 and ok.json()["transfer"] == "nccl"
    assert set(TRANSFER_STEPS) >= {"init_weight_transfer_engine", "update_weights"}


def test_the_client_posts_vllms_bodies_and_raises_on_a_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, json.loads(request.content or b"null")))
        if request.url.path.endswith("update_weights"):
            return httpx.Response(503, json={"error": "NCCL timeout"})
        return httpx.Response(200, json={"version": 3})

    def post(url: str, **kwargs: Any) -> httpx.Response:
        with httpx.Client(transport=httpx.MockTransport(handler)) as http:
            return http.post(url, **kwargs)

    monkeypatch.setattr(httpx, "post", post)
    client = FleetSyncClient("http://member:1", {}, 5.0)
    client.version = 3
    client.start_weight_update()
    client.finish_weight_update()
    with pytest.raises(RuntimeError, match="update_weights: HTTP 503"):
        client.update_weights({"names": ["w"]})
    assert seen == [
        ("/weight_transfer/start_weight_update", None),
        ("/weight_transfer/finish_weight_update", {"weight_version": "3"}),
        ("/weight_transfer/update_weights", {"update_info": {"names": ["w"]}}),
    ]


def test_the_trainers_address_is_the_one_its_route_to_the_member_leaves_from() -> None:
    assert address_towards("http://127.0.0.1:8000") == "127.0.0.1"
    assert address_towards("http://localhost:8000") == "127.0.0.1"


@pytest.mark.anyio
async def test_members_gone_between_the_sync_and_its_fingerprint_fail_at_the_deadline() -> None:
    """Every member killed after the sync reached it and before its fingerprint was
    asked (CI once caught this moment in tests/test_fleet.py): as anywhere else with no
    member left, the run fails naming ``rollout.fleet_timeout_s``, after it."""
    with anyio.fail_after(30):
        async with served(BucketEngine()) as url:
            fleet = FleetEngine([url], request_timeout_s=5, fleet_timeout_s=1.5, bucket_mb=1)
            await fleet.update_weights(STATE, 1)
        started = time.monotonic()
        gone = r"fingerprint of version 1: no fleet member serves .* \(rollout\.fleet_timeout_s\)"
        with pytest.raises(EngineError, match=gone):
            await fleet.fingerprint()
    assert time.monotonic() - started >= 1.5


def test_every_sampling_setting_travels_to_a_member() -> None:
    """A generation's Sampling crosses the wire whole: every field of it (those added
    later too) survives the round trip through WireSampling and its JSON."""
    import dataclasses

    import msgspec

    from corun.contract.engine import Sampling
    from corun.contract.fleet import WireSampling

    sampling = Sampling(max_tokens=7, temperature=0.5, top_p=0.9, stop_ids=(2, 3), top_k=5)
    wire = msgspec.json.decode(msgspec.json.encode(WireSampling.of(sampling)), type=WireSampling)
    assert wire.sampling() == sampling
    names = {f.name for f in dataclasses.fields(Sampling)}
    assert names == set(WireSampling.__struct_fields__)
