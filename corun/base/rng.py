"""Randomness by position, not by history.

Every rollout draws from a generator seeded by (run seed, data index, attempt), and
every update from one seeded by (run seed, data index): a batch is the same on any
thread, in any order, after any resume, so no trainer touches the process-wide RNGs
after set-up and nothing has to be captured or rewound. Only set-up (model init) draws
from the global RNGs, which :func:`seed_everything` seeds with ``run.seed``.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts``, the same in every process (unlike ``hash()``)."""
    text = "\x1f".join(str(part) for part in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def generator(*parts: object) -> torch.Generator:
    """A CPU torch generator seeded by :func:`stable_seed` of ``parts``."""
    return torch.Generator().manual_seed(stable_seed(*parts))


def rollout_generator(seed: int, index: int, attempt: int) -> torch.Generator:
    """What the rollout of data ``index`` draws from, on its ``attempt``-th start (0 first;
    a batch dropped as too stale is redone with the next)."""
    return generator("rollout", seed, index, attempt)


def update_generator(seed: int, index: int) -> torch.Generator:
    """What the update on the batch of data ``index`` draws from (dropout, say)."""
    return generator("update", seed, index)


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's global RNGs, as ``run`` does before set-up."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
