"""Trainer classes by name: a registered entry point (group ``corun.trainers``) or a
``"package.module:Class"`` path. Its own module so that reading a config (which asks
the trainer class for its settings Struct) and the trainer contract (which uses the
config types) do not import each other."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from corun.base.errors import ConfigError
from corun.contract.trainer import Trainer

ENTRY_POINT_GROUP = "corun.trainers"


def resolve_trainer(kind: str, where: str = "trainer.kind") -> type[Trainer[Any]]:
    """A registered name (entry point group ``corun.trainers``) or ``"module:Class"``."""
    if ":" in kind:
        module_name, _, attr = kind.partition(":")
        # importlib takes relative ("..x") and empty names with ValueError/TypeError.
        if not all(part.isidentifier() for part in module_name.split(".")):
            raise ConfigError(f"{where}: {kind!r}: {module_name!r} is not a module path")
        try:
            target: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                target = getattr(target, part)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"{where}: cannot load trainer {kind!r} ({exc})") from None
    else:
        found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
        if kind not in found:
            names = ", ".join(sorted(found)) or "none installed"
            raise ConfigError(
                f"{where}: unknown trainer {kind!r}; registered: {names}, "
                'or give "package.module:Class"'
            )
        target = found[kind].load()
    if not (isinstance(target, type) and issubclass(target, Trainer)):
        raise ConfigError(f"{where}: {kind!r} is not a corun.Trainer subclass")
    return target
