"""The vLLM server's per-token versions (corun/engines/token_versions.py): the worker's
record of each request across in-flight updates, and the versions it gives."""

from __future__ import annotations

import pytest

from corun.engines import token_versions
from corun.engines.token_versions import VersionRecord
from corun.engines.token_versions import token_versions as versions_of


def test_a_request_across_two_updates_gets_each_token_its_version() -> None:
    record = VersionRecord(version=3)
    record.scheduled(["cmpl-a-0-0-x1", "cmpl-a-1-0-x2"])
    record.switched({"cmpl-a-0-0-x1": 5, "cmpl-a-1-0-x2": 0}, version=4)
    record.scheduled(["cmpl-a-0-0-x1", "cmpl-b-0-0-x3"])  # scheduled again: keeps its start
    record.switched({"cmpl-a-0-0-x1": 9, "cmpl-b-0-0-x3": 2, "unknown": 1}, version=5)
    first, second, third, missing = record.take(
        ["cmpl-a-0-", "cmpl-a-1-", "cmpl-b-0-", "cmpl-c-0-"]
    )
    assert first is not None and second is not None and third is not None
    assert versions_of(first, 11) == [3] * 5 + [4] * 4 + [5] * 2
    assert versions_of(second, 3) == [4, 4, 4]  # no token before the first switch
    assert versions_of(third, 4) == [4, 4, 5, 5]  # started at 4
    assert missing is None
    assert record.take(["cmpl-a-0-"]) == [None]  # taken once


def test_records_nobody_takes_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(token_versions, "KEPT", 3)
    record = VersionRecord()
    record.scheduled([f"r{i}-" for i in range(5)])
    assert record.take(["r0-", "r1-", "r2-", "r4-"]) == [None, None, (0, []), (0, [])]


def test_a_streamed_request_gets_the_versions_its_record_will_give() -> None:
    """The engine's side (StreamVersions), told by each update what it found, gives every
    token the version the worker's record gives it at the end, whichever way the update
    met the request: not started, running, or ended."""
    record = VersionRecord(version=1)
    waiting, running, ended = (
        token_versions.StreamVersions(1) for _ in range(3)
    )  # submitted at version 1
    prefixes = ["cmpl-w-0-", "cmpl-r-0-", "cmpl-e-0-"]
    record.scheduled(["cmpl-r-0-0-a", "cmpl-e-0-0-b"])
    generated = {"cmpl-r-0-0-a": 4}  # e ran and ended; w has not started
    found = record.found(prefixes, generated)
    assert found == [None, 4, token_versions.ENDED]
    record.switched(generated, version=2)
    for stream, what in zip((waiting, running, ended), found, strict=True):
        stream.update(what, 2)
    record.scheduled(["cmpl-w-0-0-c"])
    generated = {"cmpl-r-0-0-a": 7, "cmpl-w-0-0-c": 2}
    for stream, what in zip((waiting, running), record.found(prefixes[:2], generated), strict=True):
        stream.update(what, 3)
    record.switched(generated, version=3)
    for stream, prefix, count in ((waiting, "cmpl-w-0-", 5), (running, "cmpl-r-0-", 10),
                                  (ended, "cmpl-e-0-", 3)):  # fmt: skip
        (kept,) = record.take([prefix])
        assert kept is not None
        assert stream.of(0, 2) + stream.of(2, count - 2) == versions_of(kept, count)
    assert running.of(0, 10) == [1] * 4 + [2] * 3 + [3] * 3
    assert waiting.of(0, 5) == [2, 2, 3, 3, 3] and ended.of(0, 3) == [1, 1, 1]
