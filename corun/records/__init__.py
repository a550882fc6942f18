"""What a run leaves on disk: checkpoint files, events and traces, metrics reporting,
the run directory's guard.
"""
