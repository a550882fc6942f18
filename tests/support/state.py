"""Trainer state compared bitwise: the resume, parity and export tests' check that two
runs ended with the same weights, optimizer state and counters."""

from __future__ import annotations

from typing import Any

import torch


def assert_state_equal(a: Any, b: Any) -> None:
    """``a`` and ``b`` (state dicts, nested dicts/lists of tensors and plain values) are
    equal, tensors bitwise."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_state_equal(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_state_equal(x, y)
    else:
        assert a == b
