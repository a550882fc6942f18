"""The routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST
/v1/chat/completions``, ``POST /v1/episodes/{id}/reward`` and ``GET /health``; and an
episode's own base URL, ``/episodes/{id}/v1`` (its ``models`` and
``chat/completions``), so a client that knows nothing of corun is recorded by setting
its base URL alone.

Chat requests take what OpenAI clients send: ``tools`` (replies parsed into
``tool_calls``), ``stop`` strings, ``n`` replies, ``seed``, ``max_tokens`` /
``max_completion_tokens``, ``logprobs`` / ``top_logprobs``, ``stream`` (server-sent
events as tokens are generated — content deltas, tool calls as tool-call deltas once
the reply is complete, with ``stream_options.include_usage`` honoured; the hold-back
rules and disconnects: streaming.py);
``tool_choice`` and ``parallel_tool_calls`` are accepted (``tool_choice: "none"``
parses no tool calls). Responses carry the sampled ``token_ids``, their log-probs and
the policy ``version``.

Every refusal is a 4xx with an OpenAI-style JSON body (``{"error": {"message",
"type", "param", "code"}}``), and the server goes on serving: malformed JSON, a wrong
type or value (400, naming the field), a missing or wrong bearer token (401), an
unknown model, route or episode (404), a prompt the model's length cannot take (400,
``context_length_exceeded``), a conversation that differs from its recorded episode
(409, naming the first message that differs).
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from corun.agents.chat import cut_at_stop, find_stop
from corun.contract.engine import Delta
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
from corun.serve.streaming import Emit, EventStream, ReplyText, TokenFeed

S = TypeVar("S")
Handler = Callable[[Request], Awaitable[Any]]
MAX_BODY = 1 << 20  # bytes
MAX_DRAINED = 64 << 20  # bytes of a refused body read before the 413 (see _decode)


def build_app(policy: ServedPolicy, batcher: Batcher, recorder: Recorder, token: str) -> Starlette:
    """The ASGI app; ``token`` (when not empty) is required as a bearer token."""
    api = _Api(policy, batcher, recorder)

    def guarded(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
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

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse(
            ServeError(exc.status_code, str(exc.detail), "invalid_request_error").body(),
            status_code=exc.status_code,
        )

    routes = [
        Route("/health", guarded(api.health), methods=["GET"]),
        Route("/v1/models", guarded(api.models), methods=["GET"]),
        Route("/v1/completions", guarded(api.completions), methods=["POST"]),
        Route("/v1/chat/completions", guarded(api.chat), methods=["POST"]),
        Route("/v1/episodes/{episode_id}/reward", guarded(api.reward), methods=["POST"]),
        # An episode's own base URL: what a client configured with it alone calls.
        Route("/episodes/{episode_id}/v1/models", guarded(api.models), methods=["GET"]),
        Route("/episodes/{episode_id}/v1/chat/completions", guarded(api.chat), methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


@dataclass
class _Choice:
    """One reply as sent: its ids (cut at a stop string), message and finish reason;
    ``stopped``: its ids end with a stop token (what a continuation follows)."""

    completion: Completion
    message: ChatMessage
    finish: str
    stopped: bool


class _Api:
    """The route handlers, over the served policy, the batcher and the recorder."""

    def __init__(self, policy: ServedPolicy, batcher: Batcher, recorder: Recorder) -> None:
        self.policy = policy
        self.batcher = batcher
        self.recorder = recorder

    async def models(self, request: Request) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.policy.name, "object": "model", "created": 0, "owned_by": "corun",
            "max_model_len": self.policy.max_len,
        }]}  # fmt: skip

    async def health(self, request: Request) -> dict[str, Any]:
        return {"status": "ok"}

    async def reward(self, request: Request) -> dict[str, Any]:
        body = await _decode(request, RewardReport)
        episode = await self.recorder.finish(request.path_params["episode_id"], body.reward)
        return {"episode_id": request.path_params["episode_id"], "submitted": True,
                "turns": episode.turns, "tokens": len(episode.ids)}  # fmt: skip

    async def completions(self, request: Request) -> Any:
        body = await _decode(request, CompletionRequest)
        policy = self.policy
        _check_model(body.model, policy)
        prompt = _encode_prompt(policy, body.prompt)
        top = body.logprobs or 0
        sampling = _sampling(policy, len(prompt), body.max_tokens, body.temperature,
                             body.top_p, top, body.ignore_eos)  # fmt: skip
        if body.stream:
            return self._stream_completion(body, prompt, sampling)
        done = (await self.batcher.generate(prompt, sampling, body.seed))[0]
        choice = self._text_choice(policy.decode(done.ids), done, body.logprobs, done.finish)
        response = _envelope("text_completion", policy, prompt, [done]) | {"choices": [choice]}
        return response

    def _text_choice(
        self, text: str, done: Completion, logprobs: int | None, finish: str | None
    ) -> dict[str, Any]:
        """A legacy completion's choice: ``text``, of ``done``'s tokens."""
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish,
                                  "token_ids": done.ids, "logprobs": None}  # fmt: skip
        if logprobs is not None:
            tops = None
            if logprobs and done.top is not None:
                tops = [{self.policy.token(i): lp for i, lp in row[:logprobs]} for row in done.top]
            tokens = [self.policy.token(i) for i in done.ids]
            choice["logprobs"] = {"tokens": tokens, "token_logprobs": done.logprobs,
                                  "top_logprobs": tops}  # fmt: skip
        return choice

    def _stream_completion(
        self, body: CompletionRequest, prompt: list[int], sampling: Sampling
    ) -> EventStream:
        """A legacy completion streamed: text chunks as tokens arrive, then the last
        with the finish reason and the usage."""
        feed, text = TokenFeed(), ReplyText(self.policy.decode, [], None, lstrip=False)
        request = self.batcher.submit(prompt, sampling, body.seed, 1, feed.sink)
        head = {"id": f"cmpl-{secrets.token_hex(8)}", "object": "text_completion",
                "created": int(time.time()), "model": self.policy.name}  # fmt: skip

        async def run(emit: Emit) -> None:
            async def each(_: int, delta: Delta) -> None:
                tokens = Completion(delta.ids, delta.logprobs, delta.versions, "length", delta.top)
                text.tokens += len(delta.ids)
                choice = self._text_choice(text.add(delta.ids), tokens, body.logprobs, None)
                await emit(head | {"version": max(delta.versions), "choices": [choice]})

            done = (await feed.run(self.batcher, request, each))[0]
            rest = text.rest(self.policy.decode(done.ids))
            choice = self._text_choice(rest, _tail(done, text.tokens), body.logprobs, done.finish)
            response = _envelope("text_completion", self.policy, prompt, [done])
            await emit(head | {"version": response["version"], "usage": response["usage"],
                               "choices": [choice]})  # fmt: skip

        return EventStream(run, feed.close)

    async def chat(self, request: Request) -> Any:
        body = await _decode(request, ChatRequest)
        episode = _episode_id(request, body)
        _check_chat(body, self.policy, episode)
        tools = body.tools or []
        names = [] if body.tool_choice == "none" else [t.function.name for t in tools]
        if episode is None:
            context = _render(self.policy, body.messages, tools)
        else:
            context = self.recorder.context(episode, body.messages, tools, body.group)
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        try:
            limit = body.max_completion_tokens or body.max_tokens
            sampling = _sampling(self.policy, len(context), limit, body.temperature, body.top_p,
                                 body.top_logprobs or 0, body.ignore_eos)  # fmt: skip
            if body.stream:
                return ChatStream(self, body, context, names, stops, episode).start(sampling)
            done = await self.batcher.generate(context, sampling, body.seed, body.n)
            choices = [_choice(self.policy, c, names, stops) for c in done]
        except BaseException:
            if episode is not None:
                self.recorder.abandon(episode)
            raise
        self.record(episode, choices)
        completions = [c.completion for c in choices]
        response = _envelope("chat.completion", self.policy, context, completions)
        shown = [self._shown(i, c, body.logprobs) for i, c in enumerate(choices)]
        return response | {"choices": shown}

    def record(self, episode: str | None, choices: list[_Choice]) -> None:
        """The reply sent, recorded in ``episode`` (if any)."""
        if episode is not None:
            first = choices[0]
            self.recorder.reply(episode, first.completion, first.message, first.stopped)

    def _shown(self, index: int, choice: _Choice, logprobs: bool) -> dict[str, Any]:
        """A choice of a chat response."""
        message = choice.message
        # `refusal` is required by the API's schema; corun's policies never refuse.
        shown: dict[str, Any] = {"role": "assistant", "content": message.content, "refusal": None}
        if message.tool_calls:
            shown["tool_calls"] = msgspec.to_builtins(message.tool_calls)
        done = choice.completion
        return {"index": index, "message": shown, "finish_reason": choice.finish,
                "logprobs": _logprobs_object(self._logprobs(done)) if logprobs else None,
                "token_ids": done.ids}  # fmt: skip

    def _logprobs(self, done: Completion) -> list[dict[str, Any]]:
        """Per-token log-probs, each with its most likely alternatives (when asked)."""
        tops = done.top if done.top is not None else [[] for _ in done.ids]
        return [
            self._token_logprob(i, lp) | {"top_logprobs": [
                self._token_logprob(j, top_lp) for j, top_lp in top
            ]}
            for i, lp, top in zip(done.ids, done.logprobs, tops, strict=True)
        ]  # fmt: skip

    def _token_logprob(self, token_id: int, logprob: float) -> dict[str, Any]:
        """A token's log-prob entry: ``bytes`` are the token's own bytes, part of a
        character where it holds part of one (its ``token`` text then shows U+FFFD), so
        a client rebuilds text split over tokens from them."""
        token_bytes = self.policy.token_bytes(token_id)
        return {"token": self.policy.token(token_id), "logprob": logprob,
                "bytes": list(token_bytes)}  # fmt: skip


class ChatStream:
    """A streamed chat reply (streaming.py's rules): the role of each choice at once,
    content deltas as tokens arrive, then, once the replies are complete and parsed as
    a whole reply is, what is still owed of each (held-back text, tool calls), its
    finish reason, and the usage when asked. The episode records what a whole reply
    records; a client that leaves first leaves the episode as it was."""

    def __init__(
        self, api: _Api, body: ChatRequest, context: list[int], names: list[str],
        stops: list[str], episode: str | None,
    ) -> None:  # fmt: skip
        self.api, self.policy, self.body = api, api.policy, body
        self.context, self.names, self.stops, self.episode = context, names, stops, episode
        marker = self.policy.tool_call_marker if names else None
        self.texts = [ReplyText(self.policy.decode, stops, marker, lstrip=True)
                      for _ in range(body.n)]  # fmt: skip
        self.feed = TokenFeed()
        self.head = {"id": f"chatcmpl-{secrets.token_hex(8)}", "object": "chat.completion.chunk",
                     "created": int(time.time()), "model": self.policy.name}  # fmt: skip
        self.version = 0  # the newest of the tokens sent
        self.roles_sent = False
        self.settled = False  # recorded or abandoned (its episode's)
        self.emit: Emit | None = None

    def start(self, sampling: Sampling) -> EventStream:
        """Submit the request (a 503 now if the batcher cannot take it) and stream it."""
        self.request = self.api.batcher.submit(self.context, sampling, self.body.seed,
                                               self.body.n, self.feed.sink)  # fmt: skip
        return EventStream(self._run, self._left)

    def _left(self) -> None:
        self.feed.close()
        self._settle(None)

    def _settle(self, choices: list[_Choice] | None) -> None:
        if not self.settled:
            self.settled = True
            if choices is not None:
                self.api.record(self.episode, choices)
            elif self.episode is not None:
                self.api.recorder.abandon(self.episode)

    async def _run(self, emit: Emit) -> None:
        self.emit = emit
        try:
            if not self.feed.whole:  # the benchmark's baseline sends nothing before the end
                await self._roles()
            done = await self.feed.run(self.api.batcher, self.request, self._delta)
            await self._roles()
            choices = [_choice(self.policy, c, self.names, self.stops) for c in done]
        except BaseException:
            self._settle(None)
            raise
        self._settle(choices)
        response = _envelope("chat.completion", self.policy, self.context,
                             [c.completion for c in choices])  # fmt: skip
        self.version = response["version"]
        for k, choice in enumerate(choices):
            await self._finish(k, choice)
        if self.body.stream_options and self.body.stream_options.include_usage:
            await emit(self.head | {"version": self.version, "choices": [],
                                    "usage": response["usage"]})  # fmt: skip

    async def _roles(self) -> None:
        if not self.roles_sent:
            self.roles_sent = True
            for k in range(self.body.n):
                await self._chunk(k, {"role": "assistant", "content": ""})

    async def _delta(self, k: int, delta: Delta) -> None:
        """New tokens of choice ``k``: the text they release, with their log-probs."""
        await self._roles()
        text = self.texts[k]
        if text.ended:  # a stop string ended it: the tokens after it are not the reply's
            return
        before = len(text.ids)
        piece = text.add(delta.ids)
        tokens = Completion(delta.ids, delta.logprobs, delta.versions, "length", delta.top)
        if text.ended:
            self.feed.end(k)  # its row may stop generating
            match = find_stop(text.ids, self.policy.decode, self.stops)
            tokens = _kept(tokens, len(delta.ids) if match is None else match.kept - before)
        self.version = max(self.version, *delta.versions)
        await self._content(k, piece, tokens)

    async def _content(self, k: int, piece: str, tokens: Completion) -> None:
        logprobs = None
        if self.body.logprobs and tokens.ids:
            logprobs = self.api._logprobs(tokens)
            self.texts[k].tokens += len(tokens.ids)
        if piece or logprobs:
            await self._chunk(k, {"content": piece}, logprobs)

    async def _finish(self, k: int, choice: _Choice) -> None:
        """What is still owed of choice ``k``, complete: text held back, log-probs not
        sent, the tool calls (id, type and name, then the arguments), the finish."""
        text, message = self.texts[k], choice.message
        await self._content(k, text.rest(message.text()), _tail(choice.completion, text.tokens))
        for i, call in enumerate(message.tool_calls or ()):
            function = {"name": call.function.name, "arguments": ""}
            opened = {"index": i, "id": call.id, "type": "function", "function": function}
            await self._chunk(k, {"tool_calls": [opened]})
            arguments = {"index": i, "function": {"arguments": call.function.arguments}}
            await self._chunk(k, {"tool_calls": [arguments]})
        await self._chunk(k, {}, finish=choice.finish)

    async def _chunk(
        self, k: int, delta: dict[str, Any], logprobs: list[Any] | None = None,
        finish: str | None = None,
    ) -> None:  # fmt: skip
        assert self.emit is not None
        content = None if logprobs is None else _logprobs_object(logprobs)
        sent = {"index": k, "delta": delta, "finish_reason": finish, "logprobs": content}
        await self.emit(self.head | {"version": self.version, "choices": [sent]})


def _choice(
    policy: ServedPolicy, done: Completion, tools: Sequence[str], stops: Sequence[str]
) -> _Choice:
    """A generated reply as sent: cut at the first stop string (the ids kept through
    the token that completes it, the content without it), parsed for tool calls."""
    stopped, finish = done.finish == "stop", done.finish
    match = find_stop(done.ids, policy.decode, stops)
    if match is not None:
        stopped = stopped and match.kept == len(done.ids)
        done = _kept(done, match.kept)
        finish = "stop"
    reply = policy.reply(done.ids, tools)
    content = reply.content
    if match is not None and not reply.tool_calls:
        content = match.text.lstrip()  # as parse() gives text
    elif match is not None and content:
        content = cut_at_stop(content, stops)
    message = ChatMessage(role="assistant", content=content, tool_calls=reply.tool_calls or None)
    return _Choice(done, message, "tool_calls" if reply.tool_calls else finish, stopped)


def _tail(done: Completion, n: int) -> Completion:
    """``done``'s tokens from the ``n``-th on."""
    top = None if done.top is None else done.top[n:]
    return Completion(done.ids[n:], done.logprobs[n:], done.versions[n:], done.finish, top)


def _kept(done: Completion, n: int) -> Completion:
    top = None if done.top is None else done.top[:n]
    return Completion(done.ids[:n], done.logprobs[:n], done.versions[:n], "stop", top)


# ----------------------------------------------------------------------------- helpers


async def _decode(request: Request, kind: type[S]) -> S:
    """The request's JSON body as ``kind``. A body over ``MAX_BODY`` is read to its end
    (up to ``MAX_DRAINED``) before the 413: a server that answers while its client is
    still sending, then closes, resets the connection, and the client gets no answer."""
    body, size = bytearray(), 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= MAX_BODY:
            body += chunk
        elif size > MAX_DRAINED:
            break
    if size > MAX_BODY:
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


def _episode_id(request: Request, body: ChatRequest) -> str | None:
    """The episode a chat request records: its base URL's, or its body's."""
    path = request.path_params.get("episode_id")
    if path is not None and body.episode_id is not None and body.episode_id != path:
        raise ServeError(400, f"episode_id {body.episode_id!r} differs from the episode "
                         f"{path!r} of the URL", param="episode_id")  # fmt: skip
    return path if path is not None else body.episode_id


def _check_chat(body: ChatRequest, policy: ServedPolicy, episode: str | None) -> None:
    _check_model(body.model, policy)
    if body.n > 1 and episode is not None:
        raise ServeError(400, "n > 1: an episode records one reply per request", param="n")
    if body.top_logprobs and not body.logprobs:
        raise ServeError(400, "top_logprobs needs logprobs: true", param="top_logprobs")


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


def _render(policy: ServedPolicy, messages: list[ChatMessage], tools: Sequence[Any]) -> list[int]:
    try:
        return policy.render(messages, tools)
    except ValueError as exc:
        raise ServeError(400, f"messages: {exc}", param="messages") from None


def _sampling(
    policy: ServedPolicy, prompt_len: int, max_tokens: int | None, temperature: float,
    top_p: float, top_logprobs: int, ignore_eos: bool,
) -> Sampling:  # fmt: skip
    room = policy.max_len - prompt_len
    tokens = room if max_tokens is None else max_tokens
    if prompt_len == 0 or tokens > room or room < 1:
        raise ServeError(400, f"this model's maximum context length is {policy.max_len} "
                         f"tokens; the prompt has {prompt_len} and {tokens} more were asked "
                         "for", param="max_tokens", code="context_length_exceeded")  # fmt: skip
    return Sampling(tokens, temperature, top_p, top_logprobs, ignore_eos)


def _logprobs_object(content: list[dict[str, Any]]) -> dict[str, Any]:
    """A choice's ``logprobs``: the content's tokens (the schema requires ``refusal``)."""
    return {"content": content, "refusal": None}


def _envelope(
    kind: str, policy: ServedPolicy, prompt: list[int], done: list[Completion]
) -> dict[str, Any]:
    generated = sum(len(c.ids) for c in done)
    return {
        "id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{secrets.token_hex(8)}",
        "object": kind, "created": int(time.time()), "model": policy.name,
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": generated,
                  "total_tokens": len(prompt) + generated},
        "version": max((v for c in done for v in c.versions), default=0),
    }  # fmt: skip


def _json(payload: Any) -> Response:
    return Response(msgspec.json.encode(payload), media_type="application/json")
