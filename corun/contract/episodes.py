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

import anyio

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
    group: str = ""  # the task it belongs to: GRPO compares the episodes of a group
    # The weights fingerprint of the version of its newest token ("" when not known):
    # set by the endpoint's capture, so training can tell which weights sampled it.
    fingerprint: str = ""

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


class EpisodeInbox:
    """Episodes from outside the run — a host's own agents (``Session.submit``), or
    the endpoint's trajectory capture — handed to the trainer's rollouts in complete
    groups: ``group_size`` episodes of one task (``Episode.group``), compared with
    each other (GRPO). Groups are handed out in the order they completed.

    ``put`` waits while ``capacity`` episodes are pending, so an agent pool faster than
    the trainer is slowed down instead of filling memory — unless the episode joins a
    group already begun (at most ``group_size - 1`` more per such group), so groups
    left incomplete by a full inbox can still complete.
    """

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._groups: dict[str, list[Episode]] = {}
        self._ready: list[str] = []  # groups with enough episodes, oldest first
        self._pending = 0
        self._changed = anyio.Event()
        self.group_size = 1  # set by the trainer that takes from the inbox

    @property
    def pending(self) -> int:
        return self._pending

    async def put(self, episode: Episode) -> None:
        # An episode that joins a group already begun never waits: groups left
        # incomplete while the inbox is full would otherwise wait on each other forever.
        while self._pending >= self.capacity and not self._begun(episode.group):
            await self._wait()
        group = self._groups.setdefault(episode.group, [])
        group.append(episode)
        self._pending += 1
        if len(group) == self.group_size:
            self._ready.append(episode.group)
        self._notify()

    def _begun(self, group: str) -> bool:
        return len(self._groups.get(group, ())) % self.group_size != 0

    async def take(self, groups: int) -> list[Episode]:
        """``groups`` complete groups, ``group_size`` episodes each, group after group."""
        while len(self._ready) < groups:
            await self._wait()
        episodes = []
        for key in self._ready[:groups]:
            group = self._groups[key]
            episodes += group[: self.group_size]
            del group[: self.group_size]
            if not group:
                del self._groups[key]
        del self._ready[:groups]
        # Leftovers of a group beyond its size start the next group of the same task.
        self._ready += [k for k, g in self._groups.items()
                        if len(g) >= self.group_size and k not in self._ready]  # fmt: skip
        self._pending -= len(episodes)
        self._notify()
        return episodes

    async def _wait(self) -> None:
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()
