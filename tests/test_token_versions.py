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
