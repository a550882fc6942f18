"""vLLM's completions API as the server engine uses it (vllm_server.py): a request's body
for one prompt, a choice read as a :class:`Generation`, and a streamed request's
chunks handed to a :data:`TokenSink` as they come, then joined as the one choice a
whole request answers.

A request asks for the sampled ids (``return_token_ids``) and their behaviour
log-probs (``logprobs: 0``, vllm_worker.py); with top log-probs, ``logprobs: k`` and
``return_tokens_as_token_ids`` (each top token as ``token_id:<id>``), and corun's
nucleus in ``vllm_xargs`` (vllm_common.nucleus_args). A streamed chunk carries the same
fields for its new tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from corun.contract.engine import Delta, Finish, Generation, Sampling, TokenSink
from corun.engines.vllm_common import nucleus_args, sampling_fields, top_entries
from corun.execution.http import sse_events

# versions(first, count): the versions of a request's tokens first .. first + count - 1
Versions = Callable[[int, int], list[int]]


def request_body(
    model: str, prompt: list[int], request_id: str, sampling: Sampling, seed: int, index: int
) -> dict[str, Any]:
    """The body of the request for prompt ``index`` of a call."""
    top: dict[str, Any] = {}
    if sampling.top_logprobs:
        nucleus = nucleus_args(sampling)
        top = {"return_tokens_as_token_ids": True, **({"vllm_xargs": nucleus} if nucleus else {})}
    return {
        "model": model, "prompt": prompt, "return_token_ids": True,
        "skip_special_tokens": False, "request_id": request_id,
        **sampling_fields(sampling, seed, index), **top,
    }  # fmt: skip


def internal_id(request_id: str, index: int) -> str:
    """The start of the id vLLM's server gives completion request
    ``f"{request_id}-{index}"`` (``cmpl-<id>-<prompt>-<suffix>``)."""
    return f"cmpl-{request_id}-{index}-0-"


def generation(choice: dict[str, Any], version: int, sampling: Sampling) -> Generation:
    """A choice (or a streamed chunk's) as a Generation, every token of ``version``."""
    ids = [int(t) for t in choice["token_ids"]]
    logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
    finish: Finish = "stop" if choice.get("finish_reason") == "stop" else "length"
    made = Generation(ids, logprobs, [version] * len(ids), finish)
    if sampling.top_logprobs:  # {"token_id:<id>": log-prob} per step
        made.top = [
            top_entries(
                ((int(key.rpartition(":")[2]), float(lp)) for key, lp in step.items()), sampling
            )
            for step in choice["logprobs"]["top_logprobs"]
        ]
    return made


async def streamed_choice(
    response: httpx.Response, row: int, versions: Versions, sampling: Sampling, sink: TokenSink
) -> dict[str, Any]:
    """Read a streamed request's chunks, each one's tokens to ``sink(row, ...)``; the
    chunks joined as one choice. Once the sink declines the row, reading stops (the
    caller closes the response, and vLLM aborts the request); its finish is then
    "length", as the engine contract says."""
    ids: list[int] = []
    logprobs: list[float] = []
    tops: list[dict[str, float]] = []
    finish = None
    async for event in sse_events(response):
        choice = (event.get("choices") or [{}])[0]  # one prompt a request: one choice
        finish = choice.get("finish_reason") or finish
        if not choice.get("token_ids"):
            continue
        piece = generation(choice, 0, sampling)
        piece.versions = versions(len(ids), len(piece.ids))
        ids += piece.ids
        logprobs += piece.logprobs
        tops += choice["logprobs"].get("top_logprobs") or []
        if not sink(row, Delta(piece.ids, piece.logprobs, piece.versions, piece.top)):
            finish = None
            break
    return {"token_ids": ids, "finish_reason": finish,
            "logprobs": {"token_logprobs": logprobs, "top_logprobs": tops}}  # fmt: skip
