"""The guessing game's FastAPI app (HTTP and the WebSocket sessions EnvClient uses)::

    uvicorn examples.openenv_guess.server.app:app --port 8000

A corun run starts it itself with ``[trainer.environment] app = "examples.openenv_guess
.server.app:app"`` (trainers/hf/openenv_task.py).
"""

from openenv.core.env_server.http_server import create_app

from examples.openenv_guess.models import GuessAction, GuessObservation
from examples.openenv_guess.server.guess_environment import GuessEnvironment

# A session per episode in flight: a GRPO step of 8 games x 8 episodes, several steps
# at once in async runs, and the held-out evaluation.
MAX_SESSIONS = 1024

app = create_app(
    GuessEnvironment, GuessAction, GuessObservation, env_name="openenv_guess",
    max_concurrent_envs=MAX_SESSIONS,
)  # fmt: skip
