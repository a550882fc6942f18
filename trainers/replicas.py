"""Weights for rollout workers on other threads (``loop.concurrency > 1``).

The trainer publishes a snapshot of its weights at each sync; each worker thread
keeps a model copy of its own and catches up with the latest snapshot before a
generation (or, for a partial rollout, between decode steps). The snapshot is
replaced, never modified, so a worker never reads weights half-way through an update.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from torch import Tensor

M = TypeVar("M")
State = dict[str, Tensor]


class Replicas(Generic[M]):
    """The latest published (version, weights), and one ``M`` per rollout thread.

    ``build`` makes a copy from (weights, version); ``load`` puts newer ones in a copy.
    """

    def __init__(
        self, build: Callable[[State, int], M], load: Callable[[M, State, int], None]
    ) -> None:
        self._build = build
        self._load = load
        self.latest: tuple[int, State] = (0, {})
        self._copies: dict[int, tuple[M, int]] = {}

    def publish(self, state: State, version: int) -> None:
        self.latest = (version, {key: value.detach().clone() for key, value in state.items()})

    def local(self) -> tuple[M, int]:
        """This thread's copy, holding the latest published weights, and their version."""
        version, state = self.latest
        thread = threading.get_ident()
        copy = self._copies.get(thread)
        if copy is None:
            copy = (self._build(state, version), version)
        elif copy[1] != version:
            self._load(copy[0], state, version)
            copy = (copy[0], version)
        self._copies[thread] = copy
        return copy

    def __len__(self) -> int:
        return len(self._copies)
