"""Errors split by who made them.

:class:`UsageError` and its subclasses are the user's: a bad config, override, data
file or checkpoint. They carry one line that names the place, and `corun` turns them
into exit status 2 without a traceback. Anything else raised by a trainer is a
training error (exit status 1).
"""

from __future__ import annotations

import anyio


class UsageError(Exception):
    """A mistake in what the user gave corun; the message is one line naming the place.

    Line breaks that reach the message from the input (a TOML key or a JSON field name
    with a newline in it) are escaped, so the message stays one line.
    """

    def __init__(self, message: str = "") -> None:
        super().__init__("\\n".join(str(message).splitlines()))


class ConfigError(UsageError):
    """A setting that cannot work (raise it from a trainer's ``setup`` naming the key,
    ``$.trainer.<key>``): the run stops before it starts, one line, exit status 2."""


class DataError(UsageError):
    pass


class CheckpointError(UsageError):
    pass


def is_cancellation(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(is_cancellation(e) for e in exc.exceptions)
    return isinstance(exc, anyio.get_cancelled_exc_class())


def first_error(exc: BaseException) -> BaseException:
    """The first real error inside (possibly nested) exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if not is_cancellation(inner):
                return first_error(inner)
        return exc.exceptions[0]
    return exc
