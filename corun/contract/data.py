"""Data sources with random access, so a resumed run seeks its cursor in O(1).

The runtime owns one integer cursor: the index of the next batch to produce. A
dataset maps an index to a batch as a pure function of (seed, index), which is what
makes "resume == uninterrupted" hold without replaying skipped batches.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import msgspec
import numpy as np

from corun.base.errors import DataError

T = TypeVar("T")


class Dataset(Protocol):
    """A data source. The loop fetches each batch on a compute lane within
    ``run.data_timeout_s`` (a source may block on I/O: a hang fails the run with one
    line). A class attribute ``in_memory = True`` says ``batch`` only computes from
    memory and cannot block: the loop then fetches it in the rollout's own lane call,
    saving a thread hop per batch, with no deadline."""

    def batch(self, index: int) -> Any:
        """The batch at ``index``; the same index always gives the same batch."""
        ...


class IndexData:
    """The default dataset: batch ``i`` is the integer ``i`` (trainers that make their own)."""

    in_memory = True

    def batch(self, index: int) -> int:
        return index


class ShuffledBatches(Generic[T]):
    """Fixed-size batches over a record list, reshuffled each epoch by (seed, epoch).

    Seeking index ``i`` computes its epoch's permutation directly: no replay.
    """

    in_memory = True

    def __init__(self, records: Sequence[T], batch_size: int, seed: int, shuffle: bool) -> None:
        if not records:
            raise DataError("data set is empty")
        self.records = records
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._epoch_cache: tuple[int, np.ndarray] | None = None

    def _order(self, epoch: int) -> np.ndarray:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            n = len(self.records)
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(n)
            else:
                order = np.arange(n)
            self._epoch_cache = (epoch, order)
        return self._epoch_cache[1]

    def batch(self, index: int) -> list[T]:
        n = len(self.records)
        start = index * self.batch_size
        out = []
        for flat in range(start, start + self.batch_size):
            epoch, pos = divmod(flat, n)
            out.append(self.records[int(self._order(epoch)[pos])])
        return out


def read_jsonl(path: str | Path, record_type: type[T]) -> list[T]:
    """Decode every line of a JSONL file as ``record_type``.

    A bad line raises :class:`DataError` naming ``file:line`` and what was wrong.
    """
    path = Path(path)
    if path.exists() and not path.is_file():  # a FIFO would block, /dev/zero never end
        raise DataError(f"{path}: not a regular file")
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise DataError(f"{path}: cannot read data file ({exc.strerror})") from None
    if lines and lines[0].startswith(codecs.BOM_UTF8):  # saved by an editor that adds one
        lines[0] = lines[0].removeprefix(codecs.BOM_UTF8)
    decoder = msgspec.json.Decoder(record_type)
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(decoder.decode(line))
        except msgspec.DecodeError as exc:
            raise DataError(f"{path}:{number}: {exc}") from None
    if not records:
        raise DataError(f"{path}: no records")
    return records
