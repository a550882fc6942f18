"""Errors split by who made them.

:class:`UsageError` and its subclasses are the user's: a bad config, override, data
file or checkpoint. They carry one line that names the place, and `corun` turns them
into exit status 2 without a traceback. Anything else raised by a trainer is a
training error (exit status 1).
"""


class UsageError(Exception):
    """A mistake in what the user gave corun; the message is one line naming the place."""


class ConfigError(UsageError):
    pass


class DataError(UsageError):
    pass


class CheckpointError(UsageError):
    pass
