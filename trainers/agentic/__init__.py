"""Agentic RL on the built-in tool task: a policy that calls a calculator over several
turns (corun/contract/episodes.py holds the environment protocol and the episode
record; corun/agents/ the episode runner, the Gymnasium adapter and the HTTP agent
client).

- :mod:`.calculator`: the task (3-digit sums with a calculator tool)
- :mod:`.policy`: the policy, running its episodes, the greedy evaluation
- :mod:`.sft`: the warm start on demonstrations (``agentic_sft``)
- :mod:`.rl`: GRPO and PPO over episodes (``agentic``, ``agentic_ppo``)
- :mod:`.serving`: the calculator policy behind the OpenAI-compatible endpoint
- :mod:`.agent`: an agent solving the task through that endpoint
"""
