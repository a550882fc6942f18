"""The rollout side's weight copies: the train thread's own, and one per rollout worker.

The train thread samples from ``home``, which a sync updates in place: at concurrency
1 rollouts and training alternate on that thread, so nothing reads it mid-update.
Rollout workers on other threads (``loop.concurrency > 1``) each keep a copy of their
own and catch up with the latest published snapshot before a generation (or, for a
partial rollout, between decode steps). The snapshot is replaced, never modified, so
a worker never reads weights half-way through an update.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from torch import Tensor

M = TypeVar("M")
State = dict[str, Tensor]


class Replicas(Generic[M]):
    """``home`` for the train thread and one ``M`` per rollout thread.

    ``build`` makes a copy from (weights, version); ``load`` puts newer ones in a copy.
    Snapshots are published only when ``shared`` (rollout workers exist); ``initial``
    is what they start from.
    """

    def __init__(
        self, home: M, build: Callable[[State, int], M], load: Callable[[M, State, int], None],
        *, shared: bool, initial: State,
    ) -> None:  # fmt: skip
        self.home = home
        self.version = 0  # of the weights in ``home``
        self._home_thread = threading.get_ident()
        self._build = build
        self._load = load
        self._shared = shared
        self.latest: tuple[int, State] = (0, {})
        self._copies: dict[int, tuple[M, int]] = {}
        self.publish(initial, 0)

    def sync(self, state: State, version: int) -> None:
        """New trained weights: into ``home`` now, and published for the workers."""
        self._load(self.home, state, version)
        self.version = version
        self.publish(state, version)

    def publish(self, state: State, version: int) -> None:
        if self._shared:
            self.latest = (version, {key: value.detach().clone() for key, value in state.items()})

    def local(self) -> tuple[M, int]:
        """The calling thread's copy, holding the latest weights, and their version."""
        thread = threading.get_ident()
        if thread == self._home_thread:
            return self.home, self.version
        version, state = self.latest
        copy = self._copies.get(thread)
        if copy is None:
            copy = (self._build(state, version), version)
        elif copy[1] != version:
            self._load(copy[0], state, version)
            copy = (copy[0], version)
        self._copies[thread] = copy
        return copy

    def __len__(self) -> int:
        """Rollout workers holding a copy (the train thread's own not counted)."""
        return len(self._copies)
