"""The template and its components: producer, update, clock, cadence, checkpointer,
kept rollouts, teardown, deadlines, the run's session.
"""
