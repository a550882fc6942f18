"""The guessing game's action and observation: text both ways, as a chat policy
speaks (corun's OpenEnv adapter fills the action's ``message`` with the reply and
shows the observation's ``message`` as the next user turn)."""

from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class GuessAction(Action):
    """A guess: the agent's reply, a number from 1 to 7 (anything else is a wasted guess)."""

    message: str = Field(..., description="The guess, as text")


class GuessObservation(Observation):
    """The game's answer: the rules at the start, then "Higher.", "Lower.", "Correct!"."""

    message: str = Field(default="", description="What the game says")
    guesses_left: int = Field(default=0, description="Guesses the agent has left")
