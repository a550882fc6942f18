"""What a run leaves on disk: checkpoint files, events and traces, metrics reporting,
the run directory's guard, and finding a finished run's checkpoint (warm starts).
"""
