"""The guessing game's Environment: one instance per session (WebSocket client)."""

from __future__ import annotations

import random
from typing import Any
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

from examples.openenv_guess.models import GuessAction, GuessObservation

LOW, HIGH = 1, 7
GUESSES = 3  # binary search over 1..7 needs at most three
# A wrong guess earns this much times the share of the numbers still possible that its
# hint rules out: a little credit for a guess that halves the range, none for one the
# hints had ruled out already. At most 2 x 0.25 < 1, the reward of finding the number.
HINT_REWARD = 0.25
RULES = f"Guess my number from {LOW} to {HIGH}."


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    """Guess the number with "Higher."/"Lower." hints; reward 1 for finding it in time."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # no state outside the instance

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._secret = LOW
        self._left = GUESSES
        self._low, self._high = LOW, HIGH  # the numbers the hints so far allow

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, task: int | None = None,
        **kwargs: Any,
    ) -> GuessObservation:  # fmt: skip
        """A new game. ``task`` picks the number (an episode of one task is the same
        game whatever its seed); without it the seed draws it."""
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._secret = LOW + task % (HIGH - LOW + 1) if task is not None else (
            random.Random(seed).randint(LOW, HIGH)
        )  # fmt: skip
        self._left = GUESSES
        self._low, self._high = LOW, HIGH
        return GuessObservation(message=RULES, guesses_left=self._left, reward=0.0)

    def step(
        self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any
    ) -> GuessObservation:
        self._state.step_count += 1
        self._left -= 1
        guess = _number(action.message)
        if guess == self._secret:
            return self._answer("Correct!", reward=1.0, done=True)
        if self._left == 0:
            return self._answer(f"No guesses left: it was {self._secret}.", reward=0.0, done=True)
        if guess is None:
            return self._answer(f"Say a number from {LOW} to {HIGH}.")
        return self._answer("Higher." if guess < self._secret else "Lower.", self._narrow(guess))

    def _narrow(self, guess: int) -> float:
        """Narrow the range by a wrong guess's hint; the hint's reward."""
        before = self._high - self._low + 1
        if guess < self._secret:
            self._low = max(self._low, guess + 1)
        else:
            self._high = min(self._high, guess - 1)
        return HINT_REWARD * (before - (self._high - self._low + 1)) / before

    def _answer(self, message: str, reward: float = 0.0, done: bool = False) -> GuessObservation:
        return GuessObservation(message=message, guesses_left=self._left, reward=reward, done=done)

    @property
    def state(self) -> State:
        return self._state


def _number(text: str) -> int | None:
    """The guess in a reply: its text a whole number in range, else None."""
    text = text.strip().rstrip(".")
    return int(text) if text.isdigit() and LOW <= int(text) <= HIGH else None
