"""Agentic episodes: the environment protocol and the token-in/token-out record.

An environment is async, so a tool call that waits on I/O (a sandbox, an API, a
simulated latency) yields to the event loop and other episodes go on meanwhile::

    observation = await env.reset(task)        # the task's first text (the prompt)
    step = await env.step(reply)               # the policy's reply text → Step

An :class:`Episode` records what the policy saw and did, token for token: the ids it
sampled are the ones trained (a transcript is never re-tokenized), each with its
behaviour log-prob and the policy version that produced it; the observation tokens
are appended once after each turn and are never trained (``trained`` is the loss
mask). Filler tokens (PAD) that batching put into the transcript stay in it, so the
model is trained on exactly the context it sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

EpisodeStatus = Literal["done", "turn_limit", "token_limit", "failed", "timeout"]
# Episodes whose environment broke are not trained on: nothing says what they earned.
UNTRAINABLE: frozenset[EpisodeStatus] = frozenset({"failed", "timeout"})


class Step(NamedTuple):
    """An environment's answer to one reply."""

    observation: str  # appended to the transcript (ignored once done)
    reward: float = 0.0  # this turn's reward; an episode's reward is the sum
    done: bool = False
    tool_call: bool = False  # the reply was a tool call ...
    tool_error: bool = False  # ... that could not be run (malformed, unknown tool)


class Environment(Protocol):
    async def reset(self, task: Any) -> str: ...

    async def step(self, reply: str) -> Step: ...


@dataclass
class Episode:
    """One multi-turn episode as the policy saw it. ``ids`` and the per-token lists run
    from the end of the prompt to the end of the episode."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)  # True on the policy's own tokens
    logprobs: list[float] = field(default_factory=list)  # behaviour log-probs (0 elsewhere)
    versions: list[int] = field(default_factory=list)  # producing version (-1 elsewhere)
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_wait_s: float = 0.0
    status: EpisodeStatus = "done"
    reason: str = ""  # why it failed or timed out

    def add_turn(
        self, ids: list[int], logprobs: list[float], versions: list[int], fillers: int,
        pad_id: int,
    ) -> None:  # fmt: skip
        """The policy's tokens of a turn, then ``fillers`` PAD tokens batching put after them."""
        self.ids += [*ids, *[pad_id] * fillers]
        self.trained += [True] * len(ids) + [False] * fillers
        self.logprobs += [*logprobs, *[0.0] * fillers]
        self.versions += [*versions, *[-1] * fillers]
        self.turns += 1

    def add_observation(self, ids: list[int]) -> None:
        self.ids += ids
        self.trained += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    @property
    def trainable(self) -> bool:
        return self.status not in UNTRAINABLE

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)
