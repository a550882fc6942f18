"""A fleet of rollout engines on other machines (``trainer.engine = "remote"``,
``[trainer.engine_options] urls``), each started with ``corun engine serve CONFIG``
(corun/serve/engine_server.py; the wire form: corun/contract/fleet.py), as one
:class:`corun.contract.engine.Engine`.

- **Generation** goes to the live member with the fewest calls in flight, except a
  multi-turn episode's next turn, which goes back to the member that served its
  previous one while that member serves (its transcript extends the one that call
  sent: that member's prefix cache holds it). A member
  that fails a call (connection refused or reset, a 5xx, no answer within
  ``request_timeout_s``) is dropped, and the call is retried on another: a generation
  is all-or-nothing, so nothing of a failed one is kept or trained twice.
- **Weights** go to every live member at each sync, streamed in buckets of
  ``bucket_mb`` over HTTP (each bucket packed once, sent to the members together), or,
  from a trainer on CUDA to a member whose vLLM runs on CUDA, GPU to GPU through vLLM's
  weight-transfer API over NCCL (weight_transfer.py; one group per member); a member
  that fails its sync is dropped. After the sync every member's fingerprint (computed
  on its side) must be the same, and the trainer checks it against the trained
  weights (trainers/hf/sync.py): a member that did not load them fails the run.
- **Rejoining**: before each sync (and each second while none serves) the dropped
  members are asked for ``/health``; one that answers is synced with the others at the
  next sync and serves from then on — never before it holds the current weights.
- **None left**: a generation or a sync waits for a member up to
  ``rollout.fleet_timeout_s`` (probing the dropped ones each second), then fails the
  run in one line.

The fleet is the user's: shutdown closes corun's connections and stops no server.
Drops and rejoins are logged as one line each on stderr (``corun: fleet: ...``) and
counted in :attr:`FleetEngine.counts`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import httpx
import msgspec
import torch
from torch import Tensor

from corun.contract.engine import EngineError, Generation, Sampling, ScoringRefused
from corun.contract.fleet import (
    Commit,
    Fingerprint,
    GenerateReply,
    GenerateRequest,
    Health,
    ScoreReply,
    ScoreRequest,
    WireSampling,
    buckets,
    pack,
)
from corun.engines.vllm_common import one_line
from corun.engines.weight_transfer import DeviceTransfer, FleetSyncClient, address_towards
from corun.execution.http import tls

R = TypeVar("R")

log = logging.getLogger("corun.fleet")
PROBE_S = 1.0  # between probes of dropped members while none serves
AFFINITY_TOKENS = 256  # a call's first prompt's start that keys its member
AFFINITY_KEYS = 4096  # starts remembered (the least recently used go first)


class _Failed(Exception):
    """A member failed a call: it is dropped."""


@dataclass(eq=False)
class Member:
    url: str
    live: bool = True
    busy: int = 0  # calls in flight
    served: int = 0  # generations it answered
    version: int = -1  # the version it holds (-1: unknown)
    # Its last answer to /health: the version, and how it takes weights.
    health: Health = field(default_factory=lambda: Health(-1))
    link: DeviceTransfer | None = None  # its NCCL group with this trainer, once opened


class FleetEngine:
    def __init__(
        self, urls: Sequence[str], *, request_timeout_s: float, fleet_timeout_s: float,
        bucket_mb: int, token: str = "", device: torch.device | None = None,
        interrupt: bool = False,
    ) -> None:  # fmt: skip
        self.members = [Member(url.rstrip("/")) for url in urls]
        self.interrupt = interrupt  # every member must take updates in flight
        self.device = device or torch.device("cpu")  # the trainer's
        self.request_timeout_s = request_timeout_s
        self.fleet_timeout_s = fleet_timeout_s
        self.bucket_bytes = bucket_mb << 20
        self.headers = {"authorization": f"Bearer {token}"} if token else {}
        self._version = 0
        self._syncing = False
        self._affinity: OrderedDict[tuple[int, ...], Member] = OrderedDict()
        self._lengths: set[int] = set()  # of the starts remembered
        self.sync_bytes = 0.0  # sent at the last sync, to every member together
        self.counts = {"dropped": 0, "rejoined": 0, "retried": 0}

    @classmethod
    async def connect(cls, urls: Sequence[str], **settings: Any) -> FleetEngine:
        """The fleet, once every member answers ``/health`` (within the start deadline
        the caller sets), each at the version it reports (the engine's start syncs
        them all before the first generation)."""
        fleet = cls(urls, **settings)
        for member in fleet.members:
            try:
                member.health = await fleet._call(member, "GET", "/health", Health)
                member.version = member.health.version
            except _Failed as exc:
                raise EngineError(f"fleet member {member.url} does not answer: {exc}") from None
            if fleet.interrupt and not member.health.interrupts:
                raise EngineError(fleet._drains(member))
        return fleet

    def _drains(self, member: Member) -> str:
        return (
            f"fleet member {member.url} drains its weight updates, and inflight_at_sync = "
            f'"interrupt" needs every member to take them in flight: serve it with a config '
            f'that sets trainer.inflight_at_sync = "interrupt"'
        )

    @property
    def version(self) -> int:
        return self._version

    @property
    def interrupts(self) -> bool:
        """Whether the members take full-weight updates in flight (then each member's
        generations carry the versions its engine stamped on their tokens)."""
        return self.interrupt

    async def generate(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, seed: int
    ) -> list[Generation]:
        body = GenerateRequest([list(p) for p in prompts], WireSampling.of(sampling), seed)
        first = tuple(prompts[0][:AFFINITY_TOKENS]) if prompts else ()
        reply = await self._on_a_member("/generate", GenerateReply, body, "generation", first)
        return [g.generation() for g in reply.generations]

    async def score(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        """A distillation teacher's scores, from the least busy member (whose engine
        must score: a local one; a member's vLLM samples only, which it refuses)."""
        body = ScoreRequest([list(p) for p in prompts], [list(c) for c in completions])
        reply = await self._on_a_member("/score", ScoreReply, body, "scoring")
        return list(reply.scores)

    async def distributions(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[Tensor]:
        raise ScoringRefused("a fleet returns the sampled tokens' scores only, not whole rows")

    async def _on_a_member(
        self, path: str, reply_type: type[R], body: Any, what: str,
        first: tuple[int, ...] = (),
    ) -> R:  # fmt: skip
        """``body`` to ``path`` on a member — the one that served the call this one
        continues (``first``, its first prompt's start), else the least busy — and on
        another when it fails (it is dropped)."""
        while True:
            member = self._follows(first) if first else None
            if member is None or member not in self._live():
                member = await self._least_busy()
            if first:
                self._remember(first, member)
            member.busy += 1
            try:
                reply: R = await self._call(member, "POST", path, reply_type, body)
                member.served += 1
                return reply
            except _Failed as exc:
                self._drop(member, f"{what} failed ({exc}); retried on another")
                self.counts["retried"] += 1
            finally:
                member.busy -= 1

    async def update_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        """Every live member (and every dropped one that answers again) to ``version``,
        bucket by bucket (one packed bucket in memory at a time, sent to the members
        together); with none left, wait for one up to ``fleet_timeout_s``."""
        deadline = time.monotonic() + self.fleet_timeout_s
        self._syncing = True  # no generation starts while the members change weights
        try:
            while True:
                await self._probe_dropped()
                sent = await self._send(state, version, [m for m in self.members if m.live])
                if any(m.live and m.version == version for m in self.members):
                    break
                self._check_deadline(deadline, f"weight sync to version {version}")
                await anyio.sleep(PROBE_S)
        finally:
            self._syncing = False
        self._version = version
        self.sync_bytes = float(sent)

    async def _send(self, state: Mapping[str, Tensor], version: int, to: list[Member]) -> int:
        """``state`` to the members ``to`` (a rejoined one too, whatever version it
        holds) and its commit; a member that fails is dropped. The bytes sent to the
        members that took it."""
        size = 0
        linked = [m for m in to if self._over_nccl(m)]
        to = [m for m in to if m not in linked]

        async def send(member: Member, data: bytes | Commit) -> None:
            if not member.live:  # failed an earlier bucket of this sync
                return
            try:
                if isinstance(data, Commit):
                    await self._call(member, "POST", f"/weights/{version}/commit", Health, data)
                    member.version = version
                else:
                    await self._call(member, "POST", f"/weights/{version}/bucket", None, data)
            except _Failed as exc:
                self._drop(member, f"its sync to version {version} failed ({exc})")

        for bucket in buckets(state, self.bucket_bytes) if to else ():
            data = await anyio.to_thread.run_sync(pack, bucket)
            size += len(data)
            async with anyio.create_task_group() as group:
                for member in to:
                    group.start_soon(send, member, data)
        async with anyio.create_task_group() as group:
            for member in to:
                group.start_soon(send, member, Commit(len(state)))
        sent = size * sum(1 for m in to if m.live and m.version == version)
        for member in linked:
            sent += await self._send_over_nccl(member, state, version)
        return sent

    def _over_nccl(self, member: Member) -> bool:
        return member.health.transfer == "nccl" and self.device.type == "cuda"

    async def _send_over_nccl(
        self, member: Member, state: Mapping[str, Tensor], version: int
    ) -> int:
        """``state`` GPU to GPU into ``member`` (its NCCL group opened at its first
        sync); the bytes sent, 0 when it failed and was dropped."""
        try:
            if member.link is None:
                member.link = await anyio.to_thread.run_sync(self._open_link, member)
            link = member.link
            assert isinstance(link.client, FleetSyncClient)
            link.client.version = version
            await anyio.to_thread.run_sync(link.send, state)
        except Exception as exc:  # HTTP or NCCL: what the member holds is unknown
            self._drop(member, f"its sync to version {version} over NCCL failed "
                               f"({one_line(exc)})")  # fmt: skip
            await self._close_link(member)
            return 0
        member.version = version
        return sum(t.numel() for t in state.values()) * link.dtype.itemsize

    def _open_link(self, member: Member) -> DeviceTransfer:
        client = FleetSyncClient(member.url, self.headers, self.request_timeout_s)
        health = member.health
        link = DeviceTransfer(
            member.url, "nccl", health.workers, getattr(torch, health.dtype or "bfloat16"),
            client=client, address=address_towards(member.url),
        )  # fmt: skip
        link.open()
        return link

    async def _close_link(self, member: Member) -> None:
        link, member.link = member.link, None
        if link is not None:
            with contextlib.suppress(Exception):  # the member may be gone
                await anyio.to_thread.run_sync(link.close)

    async def fingerprint(self) -> str:
        """The common fingerprint of the members that hold the current version;
        members that differ fail the call. With none answering (all gone since the
        sync), wait for one up to ``fleet_timeout_s``: only a member that holds the
        version counts (one back since then serves from the next sync on)."""
        deadline = time.monotonic() + self.fleet_timeout_s
        found: dict[str, list[str]] = {}
        while not found:
            for member in self._live():
                try:
                    got = await self._call(member, "GET", "/fingerprint", Fingerprint)
                except _Failed as exc:
                    self._drop(member, f"its fingerprint failed ({exc})")
                    continue
                found.setdefault(got.fingerprint, []).append(member.url)
            if not found:
                self._check_deadline(deadline, f"the fingerprint of version {self._version}")
                await anyio.sleep(PROBE_S)
                await self._probe_dropped()
        if len(found) > 1:
            seen = "; ".join(f"{', '.join(urls)}: {fp}" for fp, urls in found.items())
            raise EngineError(f"the fleet's members serve different weights ({seen})")
        return next(iter(found))

    def metrics(self) -> dict[str, float]:
        """Members serving now, MiB sent at the last sync (all members); members
        dropped, back and generations retried so far."""
        return {"fleet/members_serving": float(len(self._live())),
                "fleet/sync_mib": self.sync_bytes / 2**20,
                **{f"fleet/{k}": float(v) for k, v in self.counts.items()}}  # fmt: skip

    async def pause(self) -> None:  # each member drains its own generations at a sync
        pass

    async def resume(self) -> None:
        pass

    async def health(self) -> bool:
        return bool(self._live())

    async def shutdown(self) -> None:
        """The fleet is the user's: only this trainer's NCCL groups with it end."""
        for member in self.members:
            await self._close_link(member)

    # -- internals -------------------------------------------------------------------

    def _live(self) -> list[Member]:
        if self._syncing:
            return []
        return [m for m in self.members if m.live and m.version == self._version]

    async def _least_busy(self) -> Member:
        deadline = time.monotonic() + self.fleet_timeout_s
        while True:
            live = self._live()
            if live:
                return min(live, key=lambda m: m.busy)
            if not self._syncing:  # a sync in progress is waited for: it has its own bound
                self._check_deadline(deadline, "a generation")
            await anyio.sleep(PROBE_S)
            if not self._syncing:
                await self._probe_dropped()

    def _follows(self, first: tuple[int, ...]) -> Member | None:
        """The member that served the call this one continues: a multi-turn episode's
        next turn extends the transcript its previous call sent (the first prompt of
        a batch of episodes), so that member's prefix cache holds it."""
        for length in sorted(self._lengths, reverse=True):
            if length <= len(first) and (found := self._affinity.get(first[:length])):
                return found
        return None

    def _remember(self, first: tuple[int, ...], member: Member) -> None:
        self._affinity[first] = member
        self._affinity.move_to_end(first)
        self._lengths.add(len(first))
        while len(self._affinity) > AFFINITY_KEYS:
            self._affinity.popitem(last=False)

    def _check_deadline(self, deadline: float, what: str) -> None:
        if time.monotonic() > deadline:
            raise EngineError(
                f"{what}: no fleet member serves ({', '.join(m.url for m in self.members)}) "
                f"for {self.fleet_timeout_s:g} s (rollout.fleet_timeout_s)"
            )

    async def _probe_dropped(self) -> None:
        """Dropped members that answer again come back, and serve once the next sync
        has loaded the current weights into them (whatever version they report: a
        restarted server may report one it restored, with other weights)."""
        for member in self.members:
            if member.live:
                continue
            try:
                member.health = await self._call(member, "GET", "/health", Health, timeout_s=2.0)
            except _Failed:
                continue
            if self.interrupt and not member.health.interrupts:
                log.warning("fleet: %s answers but stays out: %s", member.url, self._drains(member))
                continue
            await self._close_link(member)  # a restarted member opens a new group
            member.live, member.version = True, -1
            self.counts["rejoined"] += 1
            log.warning("fleet: %s is back; it serves from the next sync on", member.url)

    def _drop(self, member: Member, why: str) -> None:
        if member.live:
            member.live = False
            self.counts["dropped"] += 1
            log.warning("fleet: dropped %s: %s", member.url, why)

    async def _call(
        self, member: Member, method: str, path: str, reply: type[Any] | None,
        body: Any = None, timeout_s: float | None = None,
    ) -> Any:  # fmt: skip
        content = body if isinstance(body, bytes) or body is None else msgspec.json.encode(body)
        timeout = timeout_s or self.request_timeout_s
        try:
            async with httpx.AsyncClient(timeout=timeout, verify=tls()) as client:
                response = await client.request(
                    method, member.url + path, content=content, headers=self.headers
                )
        except httpx.HTTPError as exc:
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise _Failed(why) from None
        if response.status_code >= 500:
            raise _Failed(f"HTTP {response.status_code}: {response.text[:200]}")
        if response.status_code >= 400:  # a refusal: corun sent something wrong
            raise EngineError(f"fleet member {member.url} refused {path}: {response.text[:300]}")
        return None if reply is None else msgspec.json.decode(response.content, type=reply)
