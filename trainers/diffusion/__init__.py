"""Diffusion (flow-matching) pieces shared by the flow trainers.

- :mod:`.shapes`: synthetic 16×16 coloured-shape images, prompts and pixel rewards
- :mod:`.model`: FlowDiT, a tiny conditional velocity network, and its checkpoints
- :mod:`.sampling`: Euler ODE and Flow-GRPO SDE samplers, per-step log-probs
- :mod:`.grid`: PNG sample grids with captions
- :mod:`.settings`: the config fields every flow trainer shares
"""
