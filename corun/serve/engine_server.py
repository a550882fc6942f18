"""A rollout engine served to training runs on other machines: ``corun engine serve
CONFIG`` (a serve-only session: the config's trainer is set up, restoring the run's
latest checkpoint when there is one, and its rollout engine — ``trainer.engine``,
"local" or "vllm" — is served here instead of the policy endpoint). The routes and
their bodies are corun/contract/fleet.py's; the trainer's side is corun/engines/fleet.py.

Weights arrive in buckets, staged per version, and load at the commit through the
engine's own ``update_weights`` (which drains running generations first, or, where the
config sets ``trainer.inflight_at_sync = "interrupt"``, loads them in flight: its
``/health`` says ``interrupts``); a commit
whose buckets are incomplete is refused (409) and nothing loads. A new version's first
bucket drops what an unfinished earlier one staged (its sender died mid-sync). Every
refusal is a 4xx with ``{"error": ...}``; the server goes on serving.

A member whose vLLM runs on CUDA also takes weights GPU to GPU: the trainer drives
vLLM's weight-transfer calls through ``/weight_transfer/{step}`` and the engine passes
each to vLLM's workers (the tensors travel over NCCL, not HTTP).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from torch import Tensor

from corun.base.config import ServeConfig
from corun.contract.engine import (
    Engine,
    EngineError,
    ScoringEngine,
    ScoringRefused,
    TransferEngine,
)
from corun.contract.fleet import (
    TRANSFER_STEPS,
    Commit,
    Fingerprint,
    GenerateReply,
    GenerateRequest,
    Health,
    ScoreReply,
    ScoreRequest,
    WireGeneration,
    unpack,
)
from corun.execution.compute import Lane
from corun.serve.server import HTTPService, bearer_token

MAX_BUCKET = 1 << 30  # bytes of one weights bucket


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class EngineServer(HTTPService):
    """``engine`` behind the fleet routes on ``[serve]``'s host and port."""

    def __init__(self, engine: Engine, config: ServeConfig, lane: Lane) -> None:
        super().__init__(config, lane)
        self.engine = engine
        self.staged: dict[str, Tensor] = {}
        self.staging = -1  # the version the staged tensors belong to
        token = bearer_token(config)

        def route(path: str, handler: Callable[[Request], Awaitable[Any]], method: str) -> Route:
            async def endpoint(request: Request) -> Response:
                try:
                    if token and request.headers.get("authorization") != f"Bearer {token}":
                        raise _Refused(401, "missing or wrong bearer token")
                    body = await handler(request)
                except _Refused as exc:
                    return JSONResponse({"error": str(exc)}, status_code=exc.status)
                except ScoringRefused as exc:  # asked of an engine that cannot: not a failure
                    return JSONResponse({"error": str(exc)}, status_code=409)
                except EngineError as exc:  # the engine failed: the fleet drops this member
                    return JSONResponse({"error": str(exc)}, status_code=503)
                return Response(msgspec.json.encode(body), media_type="application/json")

            return Route(path, endpoint, methods=[method])

        self.app = Starlette(routes=[
            route("/health", self.health, "GET"),
            route("/generate", self.generate, "POST"),
            route("/score", self.score, "POST"),
            route("/weights/{version:int}/bucket", self.bucket, "POST"),
            route("/weights/{version:int}/commit", self.commit, "POST"),
            route("/fingerprint", self.fingerprint, "GET"),
            route("/weight_transfer/{step}", self.weight_transfer, "POST"),
        ])  # fmt: skip

    async def health(self, request: Request) -> Health:
        engine = self.engine
        target = engine.transfer_target() if isinstance(engine, TransferEngine) else None
        if target is None:
            return Health(engine.version, interrupts=engine.interrupts)
        return Health(
            engine.version, target.backend, target.workers, target.dtype, engine.interrupts
        )

    async def generate(self, request: Request) -> GenerateReply:
        asked = await _decode(request, GenerateRequest)
        made = await self.engine.generate(asked.prompts, asked.sampling.sampling(), asked.seed)
        return GenerateReply([WireGeneration.of(g) for g in made])

    async def score(self, request: Request) -> ScoreReply:
        asked = await _decode(request, ScoreRequest)
        if len(asked.prompts) != len(asked.completions):
            raise _Refused(400, f"{len(asked.prompts)} prompts, {len(asked.completions)} "
                                "completions: one each")  # fmt: skip
        engine = self.engine
        if not isinstance(engine, ScoringEngine):
            raise _Refused(409, "this member's engine does not score tokens")
        return ScoreReply(await engine.score(asked.prompts, asked.completions))

    async def bucket(self, request: Request) -> dict[str, int]:
        version = int(request.path_params["version"])
        data = await _body(request, MAX_BUCKET)
        try:
            tensors = unpack(data)
        except ValueError as exc:
            raise _Refused(400, f"weights bucket of version {version}: {exc}") from None
        if version != self.staging:  # a new sync; an unfinished one is dropped
            self.staged, self.staging = {}, version
        self.staged.update(tensors)
        return {"staged": len(self.staged)}

    async def commit(self, request: Request) -> Health:
        version = int(request.path_params["version"])
        expected = (await _decode(request, Commit)).tensors
        if version != self.staging or len(self.staged) != expected:
            have = len(self.staged) if version == self.staging else 0
            raise _Refused(409, f"version {version}: {have} of {expected} tensors staged")
        staged, self.staged, self.staging = self.staged, {}, -1
        await self.engine.update_weights(staged, version)
        return Health(self.engine.version)

    async def weight_transfer(self, request: Request) -> Health:
        step = request.path_params["step"]
        if step not in TRANSFER_STEPS:
            raise _Refused(404, f"no weight-transfer step {step!r} (one of {TRANSFER_STEPS})")
        engine = self.engine
        if not isinstance(engine, TransferEngine) or engine.transfer_target() is None:
            raise _Refused(409, "this member takes weights in buckets only (its engine "
                                "is not vLLM on CUDA)")  # fmt: skip
        body = await _decode(request, dict[str, Any]) if await request.body() else {}
        await engine.transfer_step(step, body)
        return await self.health(request)

    async def fingerprint(self, request: Request) -> Fingerprint:
        return Fingerprint(await self.engine.fingerprint())


async def _body(request: Request, limit: int) -> bytes:
    size = int(request.headers.get("content-length") or 0)
    if size > limit:
        raise _Refused(413, f"body of {size} bytes; at most {limit}")
    return await request.body()


async def _decode(request: Request, kind: type[Any]) -> Any:
    try:
        return msgspec.json.decode(await _body(request, 64 << 20), type=kind)
    except msgspec.DecodeError as exc:
        raise _Refused(400, f"{request.url.path}: {exc}") from None
