"""Agentic RL: a policy that calls tools over several turns (corun/contract/episodes.py holds the
environment protocol and the episode record).

- :mod:`.calculator`: the built-in tool task (3-digit sums with a calculator tool)
- :mod:`.runner`: many episodes in flight per rollout, token-in/token-out
- :mod:`.sft`: the warm start on demonstrations (``agentic_sft``)
- :mod:`.rl`: GRPO and PPO over episodes (``agentic``, ``agentic_ppo``)
- :mod:`.serving`: the calculator policy behind the OpenAI-compatible endpoint
- :mod:`.gym`: Gymnasium text environments as corun environments
"""
