"""A verifiers harness that plays a single-turn chat task in process: one model call,
through the interception endpoint verifiers hands it, so verifiers records the trace
and relays the call to the run's client. verifiers' own ``null`` harness runs the
same loop as a program whose dependencies ``uv`` installs from PyPI when an episode
starts; this one needs nothing beyond the environment it runs in.

Imported by id (``corun-chat``) in the verifiers environment; never by corun.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult


class CorunChatConfig(vf.HarnessConfig):
    pass


class CorunChat(vf.Harness[CorunChatConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime, endpoint: str,
        secret: str, mcp_urls: dict[str, str], data: vf.TaskData, **_: Any,
    ) -> ProgramResult:  # fmt: skip
        system, prompt = self.resolve_prompt(data)
        messages = initial_messages(system, prompt)
        client = openai.AsyncOpenAI(
            base_url=endpoint, api_key=secret, max_retries=0, http_client=shared_http()
        )
        await client.chat.completions.create(model=ctx.model, messages=messages)
        return ProgramResult(exit_code=0, stdout="", stderr="")


_http: list[httpx.AsyncClient] = []


def shared_http() -> httpx.AsyncClient:
    """One HTTP client for every episode: a client of its own costs each episode a TLS
    context (~20 ms of CPU, ~1 MB) though it only talks to the local interception."""
    if not _http:
        _http.append(httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None)))
    return _http[0]


def initial_messages(system: str | None, prompt: object) -> list[Any]:
    """The first request's messages: the system prompt, then the task's prompt."""
    head = [{"role": "system", "content": system}] if system else []
    if isinstance(prompt, str):
        return [*head, {"role": "user", "content": prompt}]
    return [*head, *(m.model_dump(exclude_none=True) for m in prompt or [])]


__all__ = ["CorunChat"]
