"""Reading a config: a TOML file, ``KEY.PATH=VALUE`` overrides, and validation.

`[trainer]` is validated in two passes: `kind` picks the trainer class (through the
registry), whose own `Config` Struct then decodes the rest of the table. Overrides are
applied to the raw TOML tables before decoding, so they get the same checks as the
file. Every failure is a :class:`ConfigError` with one line naming the place.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import msgspec

from corun.base.config import Config, apply_override
from corun.base.errors import ConfigError
from corun.contract.registry import resolve_trainer
from corun.contract.trainer import overrides as overrides_hook
from corun.recipes import locate


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read, override and validate a config file (or a shipped recipe, by name: configs/);
    raise ConfigError with one clear line."""
    path = locate(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: malformed TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file") from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise ConfigError(f"{path}: malformed TOML: arrays or tables nested too deeply") from None
    for override in overrides:
        apply_override(raw, override)
    return config_from_dict(raw, source=str(path), overrides=overrides)


def config_from_dict(
    raw: dict[str, Any], source: str = "<config>", overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Validate raw TOML tables (as ``tomllib`` gives them) into a :class:`Config`."""

    def fail(exc: msgspec.ValidationError, prefix: str = "") -> ConfigError:
        message = str(exc).replace("`$", f"`${prefix}")
        if " - at `$" not in message:  # msgspec names no path for the top level
            message += f" - at `${prefix}`"
        culprit = _override_for(message, overrides)
        return ConfigError(f"{source}: {message}{culprit}")

    trainer_raw = raw.get("trainer")
    if not isinstance(trainer_raw, dict) or not isinstance(trainer_raw.get("kind"), str):
        raise ConfigError(
            f"{source}: Expected `str` at `$.trainer.kind`: a [trainer] table with kind = "
            '"<registered name>" or "package.module:Class" is required'
        )
    kind = trainer_raw["kind"]
    trainer_cls = resolve_trainer(kind, where=f"{source}: `$.trainer.kind`")
    try:
        trainer_config = msgspec.convert(trainer_raw, trainer_cls.Config)
    except msgspec.ValidationError as exc:
        raise fail(exc, ".trainer") from None
    try:
        config = msgspec.convert({**raw, "trainer": {"kind": kind}}, Config)
    except msgspec.ValidationError as exc:
        raise fail(exc) from None
    loop = config.loop
    if config.run.steps % loop.accumulate:
        raise ConfigError(
            f"{source}: `$.run.steps` = {config.run.steps} is not a multiple of "
            f"`loop.accumulate` = {loop.accumulate}: a run ends at the end of a window"
            + _override_for("`$.run.steps`", overrides)
        )
    if loop.mini_batches > 1 and overrides_hook(trainer_cls, "train_step"):
        raise ConfigError(
            f"{source}: `$.loop.mini_batches` = {loop.mini_batches}: trainer {kind!r} owns "
            "its whole update (train_step) and cannot split it into mini-batches"
            + _override_for("`$.loop.mini_batches`", overrides)
        )
    return msgspec.structs.replace(config, trainer=trainer_config)


def _override_for(message: str, overrides: list[str] | tuple[str, ...]) -> str:
    """Name the override that caused a validation error, when one clearly did."""
    keys = [(override, override.split("=", 1)[0].strip()) for override in overrides]
    for override, key in keys:
        if f"`$.{key}`" in message:
            return f" (from override {override!r})"
    for override, key in keys:
        table, _, leaf = key.rpartition(".")
        # An error about a table (unknown field, a cross-field check) names the key.
        if table and f"`$.{table}`" in message and f"`{leaf}`" in message:
            return f" (from override {override!r})"
    return ""
