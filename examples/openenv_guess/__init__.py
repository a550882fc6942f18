"""A number-guessing game as an OpenEnv environment (laid out as ``openenv init`` lays
out its template): the environment thinks of a number from 1 to 7, the agent guesses,
the environment answers "Higher." or "Lower." until the guess is right or three
guesses are spent. Reward 1 for the right number, 0 otherwise: binary search always
wins in three guesses, guessing at random among the numbers the hints allow wins
about two times in three.

models.py (the action and observation), server/ (the Environment and its FastAPI app,
served by uvicorn: ``uvicorn examples.openenv_guess.server.app:app``), client.py
(openenv's typed client), recipe.py and the TOML files (a corun recipe that learns it).
"""

from examples.openenv_guess.models import GuessAction, GuessObservation

__all__ = ["GuessAction", "GuessObservation"]
