"""The guessing game's demonstrations for the recipe's supervised warm start:
``python -m examples.openenv_guess.demonstrations`` writes demonstrations.jsonl.

The demonstrator opens well and then plays fair but not well: its first guess is the
middle number, 4, each later one drawn at random among the numbers the hints still
allow (it wins 17 games in 21 within three guesses; binary search, which halves the
range again, wins all). Every turn of a game is one record of hf_sft's prompt file
(trainers/hf/tasks.py's PromptRecord): the conversation so far, the game's messages
as the user's, and the demonstrator's next guess as the answer. What GRPO then adds
is the second halving.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from examples.openenv_guess.models import GuessAction
from examples.openenv_guess.server.guess_environment import HIGH, LOW, GuessEnvironment

PATH = Path(__file__).with_name("demonstrations.jsonl")
GAMES = 400


def game(rng: random.Random, task: int) -> Iterator[tuple[list[dict[str, str]], str]]:
    """One game against the environment itself: (conversation so far, next guess) per turn."""
    env = GuessEnvironment()
    observation = env.reset(task=task)
    messages = [{"role": "user", "content": observation.message}]
    low, high = LOW, HIGH
    while not observation.done:
        guess = (low + high) // 2 if low == LOW and high == HIGH else rng.randint(low, high)
        yield list(messages), str(guess)
        observation = env.step(GuessAction(message=str(guess)))
        messages += [
            {"role": "assistant", "content": str(guess)},
            {"role": "user", "content": observation.message},
        ]
        if observation.message == "Higher.":
            low = guess + 1
        elif observation.message == "Lower.":
            high = guess - 1


def records(games: int = GAMES, seed: int = 0) -> Iterator[dict[str, object]]:
    rng = random.Random(seed)
    for _ in range(games):
        for messages, guess in game(rng, rng.randrange(HIGH - LOW + 1)):
            yield {"messages": messages, "answer": guess}


def main() -> None:
    with PATH.open("w") as out:
        for record in records():
            out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
