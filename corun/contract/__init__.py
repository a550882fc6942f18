"""What a trainer author writes against: the Trainer, its contexts, data, episodes, the
rollout-engine and served-policy interfaces, config files and the registry.
"""
