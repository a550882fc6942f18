"""A number-guessing game as an OpenEnv environment (laid out as ``openenv init`` lays
out its template): the environment thinks of a number from 1 to 7, the agent guesses,
the environment answers "Higher." or "Lower." until the guess is right or three
guesses are spent. Reward 1 for the right number, and for each wrong guess 0.25 x
the share of the numbers still possible that its hint rules out: binary search always
wins in three guesses; opening with 4 and then guessing at random among the numbers
the hints allow wins 17 games in 21.

models.py (the action and observation), server/ (the Environment and its FastAPI app,
served by uvicorn: ``uvicorn examples.openenv_guess.server.app:app``), client.py
(openenv's typed client), recipe.py and the TOML files (a corun recipe that learns it).
"""

from examples.openenv_guess.models import GuessAction, GuessObservation

__all__ = ["GuessAction", "GuessObservation"]
