"""The guessing game's typed client (openenv's EnvClient: one WebSocket session per
client). corun's adapter needs none of it, its GenericEnvClient speaks dicts; this is
for playing the game by hand::

    async with GuessEnv(base_url="http://127.0.0.1:8000") as env:
        result = await env.reset(task=3)
        result = await env.step(GuessAction(message="4"))
        print(result.observation.message, result.reward, result.done)
"""

from __future__ import annotations

from typing import Any

from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server.types import State

from examples.openenv_guess.models import GuessAction, GuessObservation


class GuessEnv(EnvClient[GuessAction, GuessObservation, State]):
    def _step_payload(self, action: GuessAction) -> dict[str, Any]:
        return {"message": action.message}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[GuessObservation]:
        observation = GuessObservation(
            **payload.get("observation", {}), done=payload.get("done", False),
            reward=payload.get("reward"),
        )  # fmt: skip
        return StepResult(observation, reward=observation.reward, done=observation.done)

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(**payload)
