"""The served policy of any rollout engine: what the endpoint (corun/serve/) needs of a
chat model — rendering, continuation, reply parsing — from its :class:`ChatTemplate`,
and generation from the run's :class:`~corun.contract.engine.Engine` (transformers,
vLLM in process, a vLLM server), the same engine its rollouts sample from, so the
endpoint serves the newest synced weights and never the weights being trained.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from corun.agents.chat import TOOL_CALL_MARKER, ChatTemplate
from corun.contract.engine import Engine, TokenSink, generate_streamed
from corun.contract.engine import Sampling as EngineSampling
from corun.contract.policy import ChatMessage, Completion, Reply, Sampling, ToolSpec


class EnginePolicy:
    """The :class:`~corun.contract.policy.ServedPolicy` of ``engine`` and ``template``.
    ``fingerprints`` maps a policy version to the fingerprint of its weights (the
    trainer's record of its verified syncs; read when asked, so it may grow);
    ``continuous_batching``: whether the engine takes requests between decode steps
    (every rollout engine does) rather than one call at a time."""

    def __init__(
        self, name: str, engine: Engine, template: ChatTemplate, max_len: int,
        fingerprints: Mapping[int, str], *, continuous_batching: bool,
    ) -> None:  # fmt: skip
        self.name = name
        self.continuous_batching = continuous_batching
        self.engine = engine
        self.template = template
        self.max_len = max_len
        self.vocab_size = len(template.tokenizer)
        self.fingerprints = fingerprints
        self.tool_call_marker = TOOL_CALL_MARKER

    def encode(self, text: str) -> list[int]:
        # A completion prompt as the tokenizer encodes text (its special tokens added).
        return list(self.template.tokenizer(text)["input_ids"])

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]) -> list[int]:
        return self.template.render(messages, tools)

    def continuation(
        self, history: Sequence[ChatMessage], new: Sequence[ChatMessage],
        tools: Sequence[ToolSpec], stopped: bool,
    ) -> list[int]:  # fmt: skip
        return self.template.continuation(history, new, tools, stopped=stopped)

    def decode(self, ids: Sequence[int]) -> str:
        return self.template.decode(ids)

    def token(self, token_id: int) -> str:
        return self.template.token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        return self.template.token_bytes(token_id)

    def reply(self, ids: Sequence[int], tools: Sequence[str]) -> Reply:
        return self.template.parse(ids, tools)

    async def generate(
        self, prompts: list[list[int]], sampling: Sampling, seed: int,
        sink: TokenSink | None = None,
    ) -> list[Completion]:  # fmt: skip
        settings = EngineSampling(
            sampling.max_tokens, sampling.temperature, sampling.top_p,
            stop_ids=() if sampling.ignore_eos else self.template.stop_ids,
            top_logprobs=sampling.top_logprobs,
        )  # fmt: skip
        done = await generate_streamed(self.engine, prompts, settings, seed, sink)
        return [Completion(g.ids, g.logprobs, g.versions, g.finish, g.top) for g in done]

    def fingerprint(self, version: int) -> str:
        return self.fingerprints.get(version, "")
