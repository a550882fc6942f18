"""What a trainer implements to be served, and the OpenAI-compatible wire types.

Requests are decoded by msgspec into these Structs (unknown fields are ignored, as the
OpenAI API's clients send many); a malformed body, a wrong type or a bad value is a
400 with a JSON error naming the field. corun adds two optional fields to chat
requests — ``episode_id`` and ``group`` — that record the conversation as a training
episode (corun/serve/capture.py); the ``openai`` client sends them with
``extra_body``, or is given the episode's own base URL (``/episodes/{id}/v1``).
Responses carry the sampled token ids, their log-probs and the policy version that
produced them.

A trainer's policy is served through :class:`ServedPolicy`: a conversation rendered
once, then grown by the sampled ids of each reply and the continuation after it, so
what is trained is what was sampled (corun/agents/served.py serves any engine with a
Hugging Face chat template; trainers/agentic/serving.py is the calculator's).
``generate`` may stream: given a sink it hands each row's tokens over as they are
sampled, under the engine contract's rules (corun/contract/engine.py's ``TokenSink``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol

import msgspec

from corun.contract.engine import TokenSink

Finish = Literal["stop", "length", "tool_calls"]


class ServeError(Exception):
    """A request the endpoint refuses: HTTP ``status`` and an OpenAI-style error body."""

    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error",
        param: str | None = None, code: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}  # fmt: skip


# ----------------------------------------------------------------------------- requests


class FunctionSpec(msgspec.Struct, kw_only=True):
    name: str
    description: str = ""
    parameters: dict[str, Any] = {}


class ToolSpec(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionSpec


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as the OpenAI API sends it


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(msgspec.Struct, kw_only=True):
    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one text: None is empty, text parts are joined."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def key(self) -> tuple[Any, ...]:
        """What identifies the message when a recorded conversation is continued: role,
        text and tool calls by name and parsed arguments (ids and JSON layout ignored)."""
        calls = tuple((c.function.name, _canonical(c.function.arguments))
                      for c in self.tool_calls or ())  # fmt: skip
        return self.role, self.text(), calls


def _canonical(arguments: str) -> str:
    """JSON arguments in one layout (sorted keys, no spaces); text that is no JSON as is."""
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"))
    except ValueError:
        return arguments


Temperature = Annotated[float, msgspec.Meta(ge=0, le=2)]
TopP = Annotated[float, msgspec.Meta(gt=0, le=1)]
MaxTokens = Annotated[int, msgspec.Meta(ge=1)]
# What torch.Generator.manual_seed takes (a larger int would fail the whole batch).
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
StopString = Annotated[str, msgspec.Meta(min_length=1)]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class ChatRequest(msgspec.Struct, kw_only=True):
    model: str
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    tools: list[ToolSpec] | None = None
    tool_choice: Any = None  # accepted; "none" offers no tool to the reply's parsing
    parallel_tool_calls: bool | None = None  # accepted
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    stop: StopString | Annotated[list[StopString], msgspec.Meta(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    seed: Seed | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=8)] = 1
    ignore_eos: bool = False  # vLLM's extension: only max_tokens ends a reply
    episode_id: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None = None
    group: Annotated[str, msgspec.Meta(max_length=200)] | None = None


class CompletionRequest(msgspec.Struct, kw_only=True):
    model: str
    prompt: str | Annotated[list[int], msgspec.Meta(min_length=1)]
    max_tokens: MaxTokens = 16
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    stream: bool = False
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None
    seed: Seed | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=1)] = 1
    ignore_eos: bool = False


class RewardReport(msgspec.Struct, kw_only=True):
    reward: float


# ----------------------------------------------------------------------------- the policy


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    top_logprobs: int = 0  # 0..20 most likely tokens per sampled one (0: none)
    ignore_eos: bool = False  # no end-of-turn id ends a reply: only max_tokens (benchmarks)


@dataclass
class Completion:
    """One generated reply: the sampled ids (the stop token included), their
    behaviour log-probs, the version of each and, when asked for, the most likely
    tokens at each position as (id, log-prob), likeliest first."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish: Literal["stop", "length"]
    top: list[list[tuple[int, float]]] | None = None


@dataclass
class Reply:
    """A reply as the API shows it: text, or tool calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ServedPolicy(Protocol):
    """What the endpoint needs of a trainer's policy (``Trainer.served_policy(lane)``).

    A conversation is rendered once (``render``) and then grown token for token: the
    sampled ids of each reply, then ``continuation`` (the template's text after the
    reply and the messages that follow it) — never re-tokenized, so what is trained is
    what was sampled. ``generate`` reads the rollout side's newest published weights,
    never weights being trained.
    """

    @property
    def name(self) -> str: ...

    @property
    def max_len(self) -> int:
        """Tokens of prompt and reply together."""
        ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def continuous_batching(self) -> bool:
        """Whether ``generate`` calls may run side by side, the engine taking new
        requests between decode steps (vLLM); otherwise the endpoint gathers the
        requests that arrive during a call into the next one."""
        ...

    def encode(self, text: str) -> list[int]:
        """A completion prompt's ids (ValueError for text the vocabulary cannot hold)."""
        ...

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec]) -> list[int]:
        """A conversation's ids through the generation prompt (ValueError: the policy
        cannot take it)."""
        ...

    def continuation(
        self, history: Sequence[ChatMessage], new: Sequence[ChatMessage],
        tools: Sequence[ToolSpec], stopped: bool,
    ) -> list[int]:  # fmt: skip
        """The ids that follow the last reply's sampled ids (``history`` ends with that
        assistant message; ``stopped``: its ids ended with a stop token) through the
        next generation prompt: the template's text after the reply, then ``new``."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token(self, token_id: int) -> str:
        """One token's text (for per-token log-probs)."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own UTF-8 bytes (per-token log-probs' ``bytes``): part of a
        character where the token holds part of one, never U+FFFD's bytes in its place."""
        ...

    def reply(self, ids: Sequence[int], tools: Sequence[str]) -> Reply:
        """The reply of a generation: text, or tool calls (of ``tools`` offered)."""
        ...

    @property
    def tool_call_marker(self) -> str:
        """The text a tool call starts with in a reply (``"<tool_call>"``): a streamed
        reply's text is sent up to it, the rest when the reply is parsed. "": any reply
        may be a call, so with tools offered nothing is sent before the reply ends."""
        ...

    async def generate(
        self, prompts: list[list[int]], sampling: Sampling, seed: int,
        sink: TokenSink | None = None,
    ) -> list[Completion]:  # fmt: skip
        """One reply per prompt (the prompts may differ in length), all draws from
        ``seed``; with ``sink``, each row's tokens as they are sampled (or, from a
        policy that cannot stream, each row's at the end)."""
        ...

    def fingerprint(self, version: int) -> str:
        """The fingerprint of the weights of policy ``version`` ("" when unknown)."""
        ...
