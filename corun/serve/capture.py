"""Trajectory capture: conversations through the endpoint recorded token for token.

A chat request with an ``episode_id`` starts or continues an episode. The first
request's messages are the prompt; every reply the endpoint generates is appended as
sampled (ids, behaviour log-probs, versions: the trained tokens), and the messages a
later request adds after it (tool results, user turns) are appended once as untrained
tokens. A later request must repeat the conversation so far (the messages and the
replies as the endpoint returned them); the endpoint then reads only its new messages
— the transcript is never re-tokenized. ``POST /v1/episodes/{id}/reward`` ends the
episode with its reward and hands it to training (``EpisodeInbox``).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from corun.contract.episodes import Episode, EpisodeInbox
from corun.contract.policy import ChatMessage, Completion, ServedPolicy, ServeError


@dataclass
class _Record:
    episode: Episode
    seen: list[tuple[Any, ...]]  # the conversation so far, as ChatMessage.key()s
    touched: float = field(default_factory=time.monotonic)
    busy: bool = False  # a request of this episode is being answered


class Recorder:
    def __init__(self, policy: ServedPolicy, inbox: EpisodeInbox | None, ttl_s: float) -> None:
        self.policy = policy
        self.inbox = inbox
        self.ttl_s = ttl_s
        self._records: dict[str, _Record] = {}

    def context(self, episode_id: str, messages: list[ChatMessage], group: str | None) -> list[int]:
        """The token context of a request of ``episode_id``: the whole rendered
        conversation for a new episode, the recorded transcript plus the new messages
        for a continued one."""
        self._expire()
        record = self._records.get(episode_id)
        if record is None:
            prompt = [i for m in messages for i in _encode(self.policy, m)]
            key = group if group is not None else hashlib.sha1(bytes(str(prompt), "ascii"))
            name = key if isinstance(key, str) else key.hexdigest()[:16]
            record = _Record(Episode(prompt_ids=prompt, group=name), [m.key() for m in messages])
            self._records[episode_id] = record
        else:
            if record.busy:
                raise ServeError(409, f"episode {episode_id!r} has a request in flight",
                                 param="episode_id")  # fmt: skip
            seen = len(record.seen)
            if [m.key() for m in messages[:seen]] != record.seen:
                raise ServeError(409, f"the messages of episode {episode_id!r} differ from "
                                 "the conversation recorded so far", param="messages")  # fmt: skip
            new = messages[seen:]
            if not new or any(m.role == "assistant" for m in new):
                raise ServeError(400, "a continued episode adds user or tool messages after "
                                 "the last reply", param="messages")  # fmt: skip
            for message in new:
                record.episode.add_observation(_encode(self.policy, message))
            record.seen += [m.key() for m in new]
        record.busy = True
        record.touched = time.monotonic()
        return record.episode.prompt_ids + record.episode.ids

    def reply(self, episode_id: str, completion: Completion | None, message: ChatMessage) -> None:
        """Record the reply sent (None: the request failed; the episode goes on)."""
        record = self._records[episode_id]
        record.busy = False
        if completion is not None:
            record.episode.add_turn(
                completion.ids, completion.logprobs, completion.versions, 0, pad_id=0
            )
            record.seen.append(message.key())

    async def finish(self, episode_id: str, reward: float) -> Episode:
        record = self._records.pop(episode_id, None)
        if record is None:
            raise ServeError(404, f"no episode {episode_id!r} is being recorded",
                             param="episode_id", code="episode_not_found")  # fmt: skip
        if not record.episode.turns:
            raise ServeError(400, f"episode {episode_id!r} has no reply to train on")
        record.episode.reward = reward
        if self.inbox is not None:
            await self.inbox.put(record.episode)
        return record.episode

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        for key in [k for k, r in self._records.items() if r.touched < cutoff and not r.busy]:
            del self._records[key]


def _encode(policy: ServedPolicy, message: ChatMessage) -> list[int]:
    try:
        return policy.encode_message(message)
    except ValueError as exc:
        raise ServeError(400, f"message ({message.role}): {exc}", param="messages") from None
