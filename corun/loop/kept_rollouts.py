"""Lossless async resume (``checkpoint.keep_rollouts``): finished rollout batches that
the trainer has not trained yet are saved with the checkpoint and trained after
resume, in the order the trainer would have taken them, before any new rollout.

The ledger holds every batch a rollout worker finished, as it was handed on (data,
metrics, version, index, attempt), until training passes it. At a save, the batches
not trained at the checkpoint's position are kept: those in the stream, those in the
reorder buffer, the one a stop cut short mid-update, and — when a teardown save goes
back to the start of a window — the window's batches. Rollouts still in flight are
not kept; a resumed run generates them again with the same seeds (by position).

After resume the kept batches take admission slots like rollouts (the staleness
bound and the version schedule apply as they would have), but their rollout is
skipped: in start order each is handed on in its index's turn (an in-flight index
below it is generated first, as it would have been); in completion order they go
first, in the order they had finished. The data cursor needs nothing of its own:
a kept index is an untrained one, so a run that drops them (``keep_rollouts = false``,
or an older corun) generates them again — nothing is lost or trained twice.

The checkpoint loads with ``torch.load(weights_only=True)``: batch data is stored as
plain containers. It may be tensors, numbers, strings, None, lists, tuples and dicts
of those, and dataclasses or NamedTuples of those (their fields only); a class is
looked up among the modules already imported (the trainer's), never imported or
called by name. A trainer whose batches hold anything else is refused with one
config error at its first batch.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import torch

from corun.base.config import Config
from corun.base.errors import CheckpointError, ConfigError
from corun.contract.trainer import Batch
from corun.execution import distributed
from corun.loop.clock import Clock
from corun.records.events import EventLog

_TAG = "__corun__"  # marks an encoded container: {_TAG: kind, ...}
_PLAIN = (torch.Tensor, bool, int, float, str, type(None))  # stored as they are


@dataclasses.dataclass
class _Finished:
    """A batch as it was handed on, encoded then (training may replace its data later)."""

    index: int
    version: int
    attempt: int
    metrics: dict[str, float | int]
    data: Any  # plain containers and the batch's tensors


_FIELDS = [field.name for field in dataclasses.fields(_Finished)]  # a kept batch's entry


class KeptRollouts:
    """The ledger of finished, untrained batches; what a checkpoint keeps of them; and,
    after resume, the kept batches waiting for their turn."""

    def __init__(self, config: Config, clock: Clock, events: EventLog) -> None:
        self.enabled = config.checkpoint.keep_rollouts
        if self.enabled and distributed.world().parallel:
            raise ConfigError(
                "`$.checkpoint.keep_rollouts`: not under data-parallel training yet (each "
                "rank buffers its own shard, rank 0 writes the checkpoint); set it to false "
                "or run.nproc = 1"
            )
        self.kind = config.trainer.kind
        self.steps = config.run.steps
        self.completion = config.loop.order == "completion"
        self.clock = clock
        self.events = events
        self._ledger: dict[int, _Finished] = {}  # in the order they were handed on
        self._restored: dict[int, tuple[Batch, int]] = {}  # from the checkpoint, unclaimed

    # ------------------------------------------------------------------ producer side

    def finished(self, batch: Batch, attempt: int) -> None:
        """A rollout batch is done and about to be handed on."""
        if not self.enabled:
            return
        try:
            data = encode(batch.data, "batch.data")
            metrics = {k: _number(v, f"batch.metrics[{k!r}]") for k, v in batch.metrics.items()}
        except _Unsupported as exc:
            raise ConfigError(
                f"`$.checkpoint.keep_rollouts`: trainer {self.kind!r} makes rollout batches "
                f"a checkpoint cannot hold without pickling ({exc}); batch data must be "
                "tensors, numbers, strings, None, lists, tuples, dicts, and dataclasses or "
                "NamedTuples of those — or set checkpoint.keep_rollouts = false"
            ) from None
        start = self.clock.window_start  # what is trained before it is never untrained again
        for index in [i for i in self._ledger if _trained(i, start.cursor, start.trained_ahead)]:
            del self._ledger[index]
        self._ledger.pop(batch.index, None)  # a redone index goes to the end
        self._ledger[batch.index] = _Finished(batch.index, batch.version, attempt, metrics, data)

    def dropped(self, index: int) -> None:
        """``index``'s batch was over the staleness bound: it is generated again."""
        self._ledger.pop(index, None)

    def first(self) -> list[int]:
        """Restored indexes that are claimed before any other (completion order)."""
        return list(self._restored) if self.completion else []

    def attempts(self) -> dict[int, int]:
        """Earlier starts of the restored indexes (a dropped one is redone with new draws)."""
        return {index: attempt for index, (_, attempt) in self._restored.items() if attempt}

    def take(self, index: int) -> Batch | None:
        """The restored batch of ``index``, claimed now (it needs no rollout), or None."""
        found = self._restored.pop(index, None)
        return None if found is None else found[0]

    # ------------------------------------------------------------------ checkpoint side

    def saved(self) -> list[dict[str, Any]] | None:
        """What the checkpoint keeps: the batches not trained at the clock's position, in
        the order the trainer takes them (live tensors; the checkpointer snapshots them)."""
        if not self.enabled:
            return None
        cursor, ahead = self.clock.cursor, self.clock.trained_ahead
        kept = [f for i, f in self._ledger.items() if not _trained(i, cursor, ahead)]
        if not self.completion:
            kept.sort(key=lambda f: f.index)
        # Not dataclasses.asdict: that would deep-copy the tensors here, on the loop.
        return [{field: getattr(f, field) for field in _FIELDS} for f in kept]

    def restore(self, saved: Any, step: int) -> None:
        """Take the kept batches of the checkpoint being resumed (after set-up: their
        classes are the trainer's)."""
        if not saved:
            return
        if not self.enabled:  # generated again, as if the checkpoint had not kept them
            self.events.emit("rollouts_discarded", step, count=len(saved))
            return
        cursor, ahead = self.clock.cursor, self.clock.trained_ahead
        for number, entry in enumerate(saved):
            try:
                index = int(entry["index"])
                if _trained(index, cursor, ahead) or index >= self.steps:
                    continue  # trained already (not by corun), or past the step budget
                batch = Batch(decode(entry["data"]), dict(entry["metrics"]), int(entry["version"]))
                batch.index = index
                self._restored[index] = (batch, int(entry["attempt"]))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise CheckpointError(
                    f"checkpoint step-{step}: kept rollout batch {number} does not fit this "
                    f"trainer ({type(exc).__name__}: {exc}); resume with "
                    "checkpoint.keep_rollouts = false to generate it again"
                ) from None
        self.events.emit(
            "rollouts_restored", step, count=len(self._restored), indexes=list(self._restored)
        )


def _trained(index: int, cursor: int, ahead: set[int] | frozenset[int]) -> bool:
    return index < cursor or index in ahead


def _number(value: Any, path: str) -> float | int:
    if isinstance(value, int | float):
        return value
    try:
        return float(value)  # a numpy or 0-d tensor scalar
    except (TypeError, ValueError):
        raise _Unsupported(f"{path} is a {type(value).__qualname__}, not a number") from None


# ----------------------------------------------------------------------------- format


class _Unsupported(Exception):
    pass


def encode(value: Any, path: str) -> Any:
    """``value`` as tensors and plain containers (``torch.load(weights_only=True)``)."""
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        # Saved on the CPU (the snapshot moves it), given back on its device.
        return {_TAG: "tensor", "device": str(value.device), "value": value}
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, list):
        return [encode(item, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict):
        keys = list(value)
        return {
            _TAG: "dict",
            "keys": [encode(key, f"{path} key") for key in keys],
            "values": [encode(value[key], f"{path}[{key!r}]") for key in keys],
        }
    cls = type(value)
    if isinstance(value, tuple):
        items = [encode(item, f"{path}[{i}]") for i, item in enumerate(value)]
        if cls is tuple:
            return {_TAG: "tuple", "items": items}
        if hasattr(cls, "_fields"):
            return {_TAG: "namedtuple", "type": _name(cls, path), "items": items}
    elif dataclasses.is_dataclass(value):
        fields = {
            field.name: encode(getattr(value, field.name), f"{path}.{field.name}")
            for field in dataclasses.fields(value)
        }
        return {_TAG: "dataclass", "type": _name(cls, path), "fields": fields}
    raise _Unsupported(f"{path} is a {cls.__module__}.{cls.__qualname__}")


def _name(cls: type, path: str) -> str:
    """``module:qualname``, checked to lead back to ``cls`` (resume looks it up so)."""
    name = f"{cls.__module__}:{cls.__qualname__}"
    if _resolve(name) is not cls:
        raise _Unsupported(
            f"{path} is a {cls.__qualname__}, a class not reachable as {name} (defined "
            "inside a function?)"
        )
    return name


def decode(value: Any) -> Any:
    """The inverse of :func:`encode`. Classes are looked up among imported modules only
    and filled field by field: no constructor, no import, nothing unpickled."""
    if isinstance(value, list):
        return [decode(item) for item in value]
    if not isinstance(value, dict):
        return value
    kind = value[_TAG]
    if kind == "dict":
        return dict(zip(map(decode, value["keys"]), map(decode, value["values"]), strict=True))
    if kind == "tuple":
        return tuple(decode(item) for item in value["items"])
    if kind == "tensor":
        try:
            return value["value"].to(torch.device(value["device"]))
        except RuntimeError as exc:  # that device is not here: say so in one line
            raise ValueError(f"its tensors were on {value['device']}: {exc}") from None
    cls = _resolve(value["type"])
    if kind == "namedtuple" and cls is not None and hasattr(cls, "_fields"):
        if len(value["items"]) != len(cls._fields):
            raise ValueError(f"{value['type']} has other fields now")
        return tuple.__new__(cls, [decode(item) for item in value["items"]])
    if kind == "dataclass" and cls is not None and dataclasses.is_dataclass(cls):
        names = [field.name for field in dataclasses.fields(cls)]
        if sorted(names) != sorted(value["fields"]):
            raise ValueError(f"{value['type']} has other fields now")
        made = object.__new__(cls)  # filled as saved: no __init__, no __post_init__
        setter: Callable[[Any, str, Any], None] = object.__setattr__  # frozen ones too
        for name in names:
            setter(made, name, decode(value["fields"][name]))
        return made
    raise ValueError(f"{value.get('type', kind)!r} is not a loaded dataclass or NamedTuple")


def _resolve(name: str) -> type | None:
    """A class by ``module:qualname``, from a module already imported; else None."""
    module_name, _, qualname = str(name).partition(":")
    found: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if not isinstance(found, type):
        return None
    if issubclass(found, tuple) and hasattr(found, "_fields"):
        return found
    return found if dataclasses.is_dataclass(found) else None
