"""A test matrix CI runs in part: the cases ``long`` names carry the ``long`` mark
(``pytest -m long`` runs them; docs/testing.md says which and why)."""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def params(cases: Iterable[str], long: Iterable[str]) -> list[object]:
    """``cases`` as pytest params, those in ``long`` marked ``long``."""
    long = set(long)
    cases = list(cases)
    unknown = long - set(cases)
    assert not unknown, f"long cases that are not cases: {sorted(unknown)}"
    return [pytest.param(case, marks=[pytest.mark.long] if case in long else []) for case in cases]
