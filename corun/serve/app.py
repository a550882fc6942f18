"""The routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST
/v1/chat/completions`` (``stream: true`` as server-sent events, ``tools`` and
``tool_calls``), ``POST /v1/episodes/{id}/reward`` and ``GET /health``.

Every refusal is a 4xx with an OpenAI-style JSON body (``{"error": {"message",
"type", "param", "code"}}``), and the server goes on serving: malformed JSON, a wrong
type or value (400, naming the field), a missing or wrong bearer token (401), an
unknown model, route or episode (404), a prompt the model's length cannot take (400,
``context_length_exceeded``).
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from corun.contract.policy import (
    ChatMessage,
    ChatRequest,
    Completion,
    CompletionRequest,
    RewardReport,
    Sampling,
    ServedPolicy,
    ServeError,
)
from corun.serve.batching import Batcher
from corun.serve.capture import Recorder

S = TypeVar("S")
MAX_BODY = 1 << 20  # bytes


def build_app(policy: ServedPolicy, batcher: Batcher, recorder: Recorder, token: str) -> Starlette:
    """The ASGI app; ``token`` (when not empty) is required as a bearer token."""

    def guarded(handler: Callable[[Request], Awaitable[Any]]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            try:
                if token and request.headers.get("authorization", "") != f"Bearer {token}":
                    raise ServeError(401, "missing or wrong bearer token", "authentication_error",
                                     code="invalid_api_key")  # fmt: skip
                result = await handler(request)
            except ServeError as exc:
                return JSONResponse(exc.body(), status_code=exc.status)
            except ClientDisconnect:  # gone mid-body (e.g. the run is stopping): no one to answer
                return Response(status_code=499)
            return result if isinstance(result, Response) else _json(result)

        return endpoint

    async def models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": policy.name, "object": "model", "created": 0, "owned_by": "corun",
            "max_model_len": policy.max_len,
        }]}  # fmt: skip

    async def health(request: Request) -> dict[str, Any]:
        return {"status": "ok"}

    async def completions(request: Request) -> Any:
        body = await _decode(request, CompletionRequest)
        _check_model(body.model, policy)
        prompt = _encode_prompt(policy, body.prompt)
        sampling = _sampling(policy, len(prompt), body.max_tokens, body.temperature, body.top_p)
        done = await batcher.generate(prompt, sampling, body.seed)
        choice: dict[str, Any] = {
            "index": 0, "text": policy.decode(done.ids), "finish_reason": done.finish,
            "token_ids": done.ids, "logprobs": None,
        }  # fmt: skip
        if body.logprobs is not None:
            tokens = [policy.token(i) for i in done.ids]
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": done.logprobs,
                "top_logprobs": None,
            }
        response = _envelope("text_completion", policy, prompt, done) | {"choices": [choice]}
        if body.stream:
            return _stream([response | {"choices": [choice]}])
        return response

    async def chat(request: Request) -> Any:
        body = await _decode(request, ChatRequest)
        _check_model(body.model, policy)
        tools = [tool.function.name for tool in body.tools or ()]
        if body.episode_id is not None:
            context = recorder.context(body.episode_id, body.messages, body.group)
        else:
            context = [i for m in body.messages for i in _render(policy, m)]
        try:
            limit = body.max_completion_tokens or body.max_tokens
            sampling = _sampling(policy, len(context), limit, body.temperature, body.top_p)
            done = await batcher.generate(context, sampling, body.seed)
        except BaseException:
            if body.episode_id is not None:
                recorder.reply(body.episode_id, None, ChatMessage(role="assistant"))
            raise
        reply = policy.reply(done.ids, tools)
        message = ChatMessage(role="assistant", content=reply.content,
                              tool_calls=reply.tool_calls or None)  # fmt: skip
        if body.episode_id is not None:
            recorder.reply(body.episode_id, done, message)
        finish = "tool_calls" if reply.tool_calls else done.finish
        logprobs: dict[str, Any] | None = None
        if body.logprobs:
            logprobs = {"content": [
                {"token": policy.token(i), "logprob": lp, "bytes": None, "top_logprobs": []}
                for i, lp in zip(done.ids, done.logprobs, strict=True)
            ]}  # fmt: skip
        shown: dict[str, Any] = {"role": "assistant", "content": message.content}
        if message.tool_calls:
            shown["tool_calls"] = msgspec.to_builtins(message.tool_calls)
        choice = {"index": 0, "message": shown, "finish_reason": finish, "logprobs": logprobs,
                  "token_ids": done.ids}  # fmt: skip
        response = _envelope("chat.completion", policy, context, done) | {"choices": [choice]}
        if body.stream:
            return _stream(_chunks(response, choice, message))
        return response

    async def reward(request: Request) -> dict[str, Any]:
        body = await _decode(request, RewardReport)
        episode = await recorder.finish(request.path_params["episode_id"], body.reward)
        return {"episode_id": request.path_params["episode_id"], "submitted": True,
                "turns": episode.turns, "tokens": len(episode.ids)}  # fmt: skip

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse(
            ServeError(exc.status_code, str(exc.detail), "invalid_request_error").body(),
            status_code=exc.status_code,
        )

    routes = [
        Route("/health", guarded(health), methods=["GET"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
        Route("/v1/episodes/{episode_id}/reward", guarded(reward), methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


# ----------------------------------------------------------------------------- helpers


async def _decode(request: Request, kind: type[S]) -> S:
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise ServeError(413, f"request body over {MAX_BODY} bytes")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise ServeError(400, f"invalid request: {exc}", param=_path(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise ServeError(400, f"malformed JSON: {exc}") from None


def _path(message: str) -> str | None:
    """The field a msgspec validation message names (``- at `$.messages[0].role```)."""
    text, _, where = message.partition(" - at `")
    where = where.rstrip("`").removeprefix("$.")
    missing = re.fullmatch(r"Object missing required field `(.+)`", text)
    if missing:  # msgspec names the object the field is missing from
        where = missing[1] if where in ("", "$") else f"{where}.{missing[1]}"
    return where or None


def _check_model(model: str, policy: ServedPolicy) -> None:
    if model != policy.name:
        raise ServeError(404, f"the model {model!r} does not exist; this endpoint serves "
                         f"{policy.name!r}", param="model", code="model_not_found")  # fmt: skip


def _encode_prompt(policy: ServedPolicy, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        if not all(0 <= i < policy.vocab_size for i in prompt):
            raise ServeError(400, f"token ids must be in [0, {policy.vocab_size})", param="prompt")
        return prompt
    try:
        return policy.encode(prompt)
    except ValueError as exc:
        raise ServeError(400, f"prompt: {exc}", param="prompt") from None


def _render(policy: ServedPolicy, message: ChatMessage) -> list[int]:
    try:
        return policy.encode_message(message)
    except ValueError as exc:
        raise ServeError(400, f"message ({message.role}): {exc}", param="messages") from None


def _sampling(
    policy: ServedPolicy, prompt_len: int, max_tokens: int | None, temperature: float,
    top_p: float,
) -> Sampling:  # fmt: skip
    room = policy.max_len - prompt_len
    tokens = room if max_tokens is None else max_tokens
    if prompt_len == 0 or tokens > room or room < 1:
        raise ServeError(400, f"this model's maximum context length is {policy.max_len} "
                         f"tokens; the prompt has {prompt_len} and {tokens} more were asked "
                         "for", param="max_tokens", code="context_length_exceeded")  # fmt: skip
    return Sampling(tokens, temperature, top_p)


def _envelope(
    kind: str, policy: ServedPolicy, prompt: list[int], done: Completion
) -> dict[str, Any]:
    return {
        "id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{secrets.token_hex(8)}",
        "object": kind, "created": int(time.time()), "model": policy.name,
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(done.ids),
                  "total_tokens": len(prompt) + len(done.ids)},
        "version": max(done.versions, default=0),
    }  # fmt: skip


def _chunks(
    response: dict[str, Any], choice: dict[str, Any], message: ChatMessage
) -> list[dict[str, Any]]:
    """A chat response as stream chunks: the role, the content or the tool calls, the end."""
    head = {k: v for k, v in response.items() if k not in ("choices", "usage")}
    head["object"] = "chat.completion.chunk"

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return head | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                    "logprobs": None}]}  # fmt: skip

    parts = [chunk({"role": "assistant", "content": ""})]
    if message.tool_calls:
        calls = [{"index": i, **msgspec.to_builtins(c)} for i, c in enumerate(message.tool_calls)]
        parts.append(chunk({"tool_calls": calls}))
    elif message.content:
        parts.append(chunk({"content": message.content}))
    return [*parts, chunk({}, choice["finish_reason"]) | {"usage": response["usage"]}]


def _stream(events: list[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        for event in events:
            yield b"data: " + msgspec.json.encode(event) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def _json(payload: Any) -> Response:
    return Response(msgspec.json.encode(payload), media_type="application/json")
