"""Trajectory capture: conversations through the endpoint recorded token for token.

A chat request with an ``episode_id`` (in the body, or in the path of the episode's
base URL ``/episodes/{id}/v1``) starts or continues an episode. The first request's
messages, rendered by the policy's chat template, are the prompt; every reply the
endpoint generates is appended as sampled (ids, behaviour log-probs, versions: the
trained tokens), and the messages a later request adds after it (tool results, user
turns) are appended once, untrained, as the template's continuation after the reply.

A later request repeats the conversation so far — the messages and the replies as the
endpoint returned them — and is matched by content, never re-tokenized: role, text
(None is empty, text parts joined) and tool calls by name and parsed arguments (ids and
JSON layout do not matter). The first message that differs is named in a 409. Only
when the reply is recorded are the new messages committed, so a request that fails
(too long, say) leaves the episode as it was. ``POST /v1/episodes/{id}/reward`` ends
the episode with its reward and hands it to training (``EpisodeInbox``).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from corun.contract.episodes import Episode, EpisodeInbox
from corun.contract.policy import ChatMessage, Completion, ServedPolicy, ServeError, ToolSpec


@dataclass
class _Record:
    episode: Episode
    messages: list[ChatMessage]  # the conversation so far, as recorded
    stopped: bool = True  # the last reply's ids ended with a stop token
    touched: float = field(default_factory=time.monotonic)
    busy: bool = False  # a request of this episode is being answered
    # That request's new messages and their ids (committed with its reply).
    pending: tuple[list[ChatMessage], list[int]] = field(default_factory=lambda: ([], []))


class Recorder:
    def __init__(self, policy: ServedPolicy, inbox: EpisodeInbox | None, ttl_s: float) -> None:
        self.policy = policy
        self.inbox = inbox
        self.ttl_s = ttl_s
        self._records: dict[str, _Record] = {}

    def context(
        self, episode_id: str, messages: list[ChatMessage], tools: Sequence[ToolSpec],
        group: str | None,
    ) -> list[int]:  # fmt: skip
        """The token context of a request of ``episode_id``: the rendered conversation
        for a new episode, the recorded transcript and the continuation of the new
        messages for a continued one. The episode is busy until :meth:`reply` or
        :meth:`abandon`."""
        self._expire()
        record = self._records.get(episode_id)
        if record is not None and record.busy:
            raise ServeError(409, f"episode {episode_id!r} has a request in flight",
                             param="episode_id")  # fmt: skip
        if record is None:  # new (a first request that failed left nothing behind)
            prompt = _policy_call(self.policy.render, messages, tools)
            if group is None:  # the task is the prompt
                group = hashlib.sha1(str(prompt).encode()).hexdigest()[:16]
            record = _Record(Episode(prompt_ids=prompt, group=group), list(messages))
            self._records[episode_id] = record
        else:
            new = self._new_messages(episode_id, record, messages)
            ids = _policy_call(self.policy.continuation, record.messages, new, tools,
                               record.stopped)  # fmt: skip
            record.pending = (new, ids)
        record.busy = True
        record.touched = time.monotonic()
        episode = record.episode
        return [*episode.prompt_ids, *episode.ids, *record.pending[1]]

    def _new_messages(
        self, episode_id: str, record: _Record, messages: list[ChatMessage]
    ) -> list[ChatMessage]:
        seen = len(record.messages)
        for i, recorded in enumerate(record.messages):
            if i >= len(messages) or messages[i].key() != recorded.key():
                role = messages[i].role if i < len(messages) else recorded.role
                message = (f"message {i} ({role}) differs from the conversation recorded "
                           f"for episode {episode_id!r}")  # fmt: skip
                raise ServeError(409, message, param="messages")
        new = messages[seen:]
        if not new or any(m.role == "assistant" for m in new):
            raise ServeError(400, "a continued episode adds user or tool messages after "
                             "the last reply", param="messages")  # fmt: skip
        return new

    def reply(
        self, episode_id: str, completion: Completion, message: ChatMessage, stopped: bool
    ) -> None:
        """Record the reply sent: ``completion``'s ids as sampled (``stopped``: they end
        with a stop token), after the request's new messages."""
        record = self._records[episode_id]
        new, ids = record.pending
        episode = record.episode
        episode.add_observation(ids)
        episode.add_turn(completion.ids, completion.logprobs, completion.versions, 0, pad_id=0)
        episode.tool_calls += len(message.tool_calls or ())
        episode.fingerprint = self.policy.fingerprint(max(episode.versions))
        record.messages += [*new, message]
        record.stopped = stopped
        record.busy, record.pending = False, ([], [])

    def abandon(self, episode_id: str) -> None:
        """The request failed: the episode goes on as it was (a new one is forgotten)."""
        record = self._records[episode_id]
        record.busy, record.pending = False, ([], [])
        if not record.episode.turns:
            del self._records[episode_id]

    async def finish(self, episode_id: str, reward: float) -> Episode:
        record = self._records.get(episode_id)
        if record is None:
            raise ServeError(404, f"no episode {episode_id!r} is being recorded",
                             param="episode_id", code="episode_not_found")  # fmt: skip
        if not record.episode.turns:
            raise ServeError(400, f"episode {episode_id!r} has no reply to train on")
        if record.busy:
            raise ServeError(409, f"episode {episode_id!r} has a request in flight",
                             param="episode_id")  # fmt: skip
        del self._records[episode_id]
        record.episode.reward = reward
        if self.inbox is not None:
            await self.inbox.put(record.episode)
        return record.episode

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        for key in [k for k, r in self._records.items() if r.touched < cutoff and not r.busy]:
            del self._records[key]


def _policy_call(fn: Callable[..., list[int]], *args: Any) -> list[int]:
    """``fn(*args)`` of the policy; what it cannot take is a 400 naming the messages."""
    try:
        ids = fn(*args)
    except ValueError as exc:
        raise ServeError(400, f"messages: {exc}", param="messages") from None
    return ids
