"""Dotted names as the docs write them: ``package.module.attribute.attribute``."""

from __future__ import annotations

import importlib


def resolve(name: str) -> object:
    """The object ``name`` names: the longest importable module prefix, then attributes
    of it. LookupError when nothing is there."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:n]))
        except ImportError:
            continue
        for part in parts[n:]:
            if not hasattr(found, part):
                raise LookupError(f"{name}: {'.'.join(parts[:n])} has no {part!r} on the way")
            found = getattr(found, part)
        return found
    raise LookupError(f"{name}: no importable module")
