"""The Tinker API's routes (``/api/v1/...``, as SDK 0.38 calls them) over a
:class:`~corun.serve.tinker.service.TinkerService`.

Work (creating a model, forward-backward, an optimizer step, saves, loads, samples) is
answered at once with a request id; ``retrieve_future`` holds the poll until the result
is ready (up to :data:`HOLD_S`, then "try again"). A request the server cannot serve —
a bad shape, an unknown model, a ``seq_id`` out of order — fails its future with the
SDK's ``user`` category and a message naming the field, and the server goes on; a body
that cannot even be read is a 400 with ``{"detail", "category": "user"}``, an unknown
route a 404 naming it. Answers are chosen so that the SDK never retries a refusal.
"""

from __future__ import annotations

import shutil
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from corun.contract.training_api import RequestError
from corun.serve.tinker import wire
from corun.serve.tinker.futures import Future
from corun.serve.tinker.service import Busy, TinkerService, read_record, tinker_path

HOLD_S = 25.0  # a poll held open this long, then "try again" (the SDK waits 45 s)
MAX_BODY = 256 << 20
API = "/api/v1"
# The client's settings: forward-backward chunks sent one after another (in seq_id
# order), uncompressed; no JWT exchange; one poll per future.
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": False,
    "proto_compress_fwdbwd": False, "use_pyqwest_transport": False,
    "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}  # fmt: skip
Handler = Callable[[Request], Awaitable[Any]]


class Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def build_app(service: TinkerService, token: str) -> Starlette:
    """The ASGI app; ``token`` (when not empty) is required as the ``X-API-Key``."""
    api = _Api(service)

    def guarded(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                if token and request.headers.get("x-api-key", "") != token:
                    raise Refused(401, "missing or wrong X-API-Key")
                result = await handler(request)
            except RequestError as exc:
                return _refusal(400, str(exc))
            except Refused as exc:
                return _refusal(exc.status, str(exc))
            except Busy as exc:
                return _refusal(429, str(exc))
            except ClientDisconnect:
                return Response(status_code=499)
            if isinstance(result, Future):
                return JSONResponse({"request_id": result.request_id})
            return result if isinstance(result, Response) else JSONResponse(result)

        return endpoint

    async def not_served(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        what = f"{request.method} {request.url.path}"
        return _refusal(exc.status_code, f"{what}: not served by corun's Tinker server "
                        "(its compatibility table: docs/tinker.md)")  # fmt: skip

    routes = [Route(f"{API}/{path}", guarded(handler), methods=[method])
              for method, path, handler in api.routes()]  # fmt: skip
    return Starlette(routes=routes, exception_handlers={HTTPException: not_served})


def _refusal(status: int, message: str) -> Response:
    return JSONResponse({"detail": message, "category": "user"}, status_code=status)


class _Api:
    def __init__(self, service: TinkerService) -> None:
        self.service = service

    def routes(self) -> list[tuple[str, str, Handler]]:
        return [
            ("POST", "client/config", self.client_config),
            ("POST", "client/dynamic_config", self.dynamic_config),
            ("POST", "create_session", self.create_session),
            ("POST", "session_heartbeat", self.heartbeat),
            ("POST", "telemetry", self.telemetry),
            ("POST", "sessions/{session_id}/finish", self.finish),
            ("POST", "create_model", self.create_model),
            ("POST", "get_info", self.get_info),
            ("POST", "forward_backward", self.forward_backward),
            ("POST", "optim_step", self.optim_step),
            ("POST", "save_weights", self.save_weights),
            ("POST", "save_weights_for_sampler", self.save_for_sampler),
            ("POST", "load_weights", self.load_weights),
            ("POST", "create_sampling_session", self.create_sampling_session),
            ("GET", "samplers/{sampler_id}", self.get_sampler),
            ("POST", "asample", self.sample),
            ("POST", "retrieve_future", self.retrieve_future),
            ("GET", "training_runs/{model_id}", self.training_run),
            ("GET", "training_runs/{model_id}/checkpoints", self.list_checkpoints),
            ("DELETE", "training_runs/{model_id}/checkpoints/{kind}/{name}", self.delete),
            ("POST", "weights_info", self.weights_info),
            ("GET", "get_server_capabilities", self.capabilities),
            ("GET", "healthz", self.health),
        ]

    # ---- the client and its session

    async def client_config(self, request: Request) -> dict[str, Any]:
        version = str((await _json(request, dict)).get("sdk_version", ""))
        if version.rsplit(".", 1)[0] != wire.SDK_VERSION.rsplit(".", 1)[0]:
            raise Refused(400, f"Tinker SDK {version or '(unknown)'}: corun serves SDK "
                          f"{wire.SDK_VERSION} (pip install 'corun[tinker]')")  # fmt: skip
        return CLIENT_CONFIG

    async def dynamic_config(self, request: Request) -> dict[str, Any]:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    async def create_session(self, request: Request) -> dict[str, Any]:
        return {"type": "create_session", "session_id": self.service.create_session()}

    async def heartbeat(self, request: Request) -> dict[str, Any]:
        return {"type": "session_heartbeat"}

    async def telemetry(self, request: Request) -> dict[str, Any]:
        return {"status": "accepted"}

    async def finish(self, request: Request) -> Response:
        self.service.finish_session(request.path_params["session_id"])
        return Response(status_code=204)

    async def health(self, request: Request) -> dict[str, Any]:
        return {"status": "ok"}

    async def capabilities(self, request: Request) -> dict[str, Any]:
        limit = self.service.backend.max_length
        return {"supported_models": [
            {"model_name": name, "max_context_length": limit, "trainable": True,
             "sampleable": True} for name in self.service.backend.base_models()
        ]}  # fmt: skip

    # ---- models

    async def create_model(self, request: Request) -> dict[str, Any]:
        body = await _json(request, wire.CreateModel)
        future = self.service.create_model(body)
        model_id = f"{body.session_id}:train:{body.model_seq_id}"
        return {"request_id": future.request_id, "model_id": model_id}

    async def get_info(self, request: Request) -> dict[str, Any]:
        body = await _json(request, wire.SessionRequest)
        model = self.service.model(body.model_id or "")
        info = model.info
        return {"type": "get_info", "model_id": model.model_id, "is_lora": True,
                "lora_rank": info.lora_rank, "model_name": info.base_model,
                "model_data": {"arch": "corun", "model_name": info.base_model,
                               "tokenizer_id": info.tokenizer}}  # fmt: skip

    async def forward_backward(self, request: Request) -> dict[str, Any]:
        if request.headers.get("content-encoding"):
            raise Refused(400, "compressed bodies are not served (client/config says so)")
        model_id, seq_id, loss, config, forward_only, data = wire.forward_backward_request(
            await _body(request)
        )
        future = self.service.in_turn(model_id, seq_id, "forward_backward", lambda m: (
            self.service.forward_backward(m, loss, config, forward_only, data)))  # fmt: skip
        return {"request_id": future.request_id, "model_id": model_id}

    async def optim_step(self, request: Request) -> dict[str, Any]:
        body = await _json(request, wire.OptimStep)
        return self._in_turn(body, "optim_step", lambda m: self.service.optim_step(m, body))

    async def save_weights(self, request: Request) -> dict[str, Any]:
        body = await _json(request, wire.SaveWeights)
        return self._in_turn(body, "save_weights", lambda m: self.service.save(m, body, "weights"))

    async def save_for_sampler(self, request: Request) -> dict[str, Any]:
        body = await _json(request, wire.SaveWeights)
        return self._in_turn(body, "save_weights_for_sampler",
                             lambda m: self.service.save(m, body, "sampler_weights"))  # fmt: skip

    async def load_weights(self, request: Request) -> dict[str, Any]:
        body = await _json(request, wire.LoadWeights)
        if body.model_id is None:  # a new model from the state
            if body.session_id is None or body.model_seq_id is None:
                raise RequestError("load_weights: model_id, or session_id and model_seq_id")
            future = self.service.create_from_state(body)
            return {"request_id": future.request_id,
                    "model_id": f"{body.session_id}:train:{body.model_seq_id}"}  # fmt: skip
        request_body = wire.ModelRequest(model_id=body.model_id, seq_id=body.seq_id)
        return self._in_turn(request_body, "load_weights", lambda m: self.service.load(m, body))

    def _in_turn(self, body: wire.ModelRequest, kind: str, job: Any) -> dict[str, Any]:
        future = self.service.in_turn(body.model_id, body.seq_id, kind, job)
        return {"request_id": future.request_id, "model_id": body.model_id}

    # ---- sampling

    async def create_sampling_session(self, request: Request) -> dict[str, Any]:
        body = await _json(request, wire.CreateSamplingSession)
        return {"type": "create_sampling_session",
                "sampling_session_id": self.service.create_sampler(body)}  # fmt: skip

    async def get_sampler(self, request: Request) -> dict[str, Any]:
        sampler_id = request.path_params["sampler_id"]
        ref = self.service.samplers.get(sampler_id)
        if ref is None:
            raise Refused(404, f"sampler {sampler_id!r}: no such sampling session here")
        return {"sampler_id": sampler_id, "base_model": ref.base_model,
                "model_path": ref.model_path}  # fmt: skip

    async def sample(self, request: Request) -> dict[str, Any]:
        body = await _json(request, wire.Sample)
        future = self.service.sample(body)
        ids = [f"{future.request_id}:{i}" for i in range(max(body.num_samples, 0))]
        return {"request_id": future.request_id, "sample_sequence_ids": ids}

    # ---- futures

    async def retrieve_future(self, request: Request) -> Response:
        body = await _json(request, wire.RequestId)
        future = self.service.futures.get(body.request_id)
        if future is None:
            raise Refused(404, f"request_id {body.request_id!r}: unknown, or collected long ago")
        reply = await future.wait(HOLD_S)
        if reply is None:
            return JSONResponse({"type": "try_again", "request_id": body.request_id,
                                 "queue_state": "active"})  # fmt: skip
        return Response(reply.body, media_type=reply.media)

    # ---- saved states (the REST client)

    async def training_run(self, request: Request) -> dict[str, Any]:
        model_id = request.path_params["model_id"]
        saved = self.service.checkpoints(model_id)
        model = self.service.models.get(model_id)
        if model is None and not saved:
            raise Refused(404, f"training run {model_id!r}: no such model here")
        base, shape = self._shape(model_id)
        return {"training_run_id": model_id, "base_model": base, "model_owner": "local",
                "is_lora": True, "lora_rank": shape, "corrupted": False,
                "last_request_time": saved[-1]["time"] if saved else "1970-01-01T00:00:00Z",
                "last_checkpoint": None, "last_sampler_checkpoint": None}  # fmt: skip

    def _shape(self, model_id: str) -> tuple[str, int]:
        model = self.service.models.get(model_id)
        if model is not None:
            return model.base_model, model.shape.rank
        first = self.service.checkpoints(model_id)[0]["tinker_path"]
        base, shape = read_record(self.service.resolve(first)[0])
        return base, shape.rank

    async def list_checkpoints(self, request: Request) -> dict[str, Any]:
        return {"checkpoints": self.service.checkpoints(request.path_params["model_id"]),
                "cursor": None}  # fmt: skip

    async def delete(self, request: Request) -> Response:
        params = request.path_params
        path = tinker_path(params["model_id"], params["kind"], params["name"])
        directory, _ = self.service.resolve(path)
        shutil.rmtree(directory)
        return Response(status_code=204)

    async def weights_info(self, request: Request) -> dict[str, Any]:
        body = await _json(request, wire.SessionRequest)
        base, shape = read_record(self.service.resolve(body.tinker_path or "")[0])
        return {"base_model": base, "is_lora": True, "lora_rank": shape.rank,
                "train_attn": shape.train_attn, "train_mlp": shape.train_mlp,
                "train_unembed": shape.train_unembed}  # fmt: skip


async def _body(request: Request) -> bytes:
    size = int(request.headers.get("content-length") or 0)
    if size > MAX_BODY:
        raise Refused(413, f"a body of {size} bytes; at most {MAX_BODY}")
    return await request.body()


async def _json(request: Request, kind: type[Any]) -> Any:
    return wire.decode(await _body(request), kind)
