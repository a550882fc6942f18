"""Small character-level language models and verifiable tasks shared by the LM trainers.

SFT, GRPO and PPO all train the same :class:`~trainers.lm.model.TinyLM` on the same
synthetic tasks, so an SFT checkpoint can warm-start an RL run.
"""
