"""``perf/mfu``: the update's achieved matmul FLOP/s over the machine's peak, both
measured in the same run (the ratio torchtitan reports as MFU).

The update's FLOPs are counted once, on its first call, by torch's ``FlopCounterMode``
(the matmuls of forward, backward and any recomputation: what the hardware did),
as FLOPs per unit of work — a token of the rows the passes computed, padding
included, or a loss call for a trainer that reports no row lengths; later calls are
estimated from their work, so counting costs one step, not every step. The peak is
a square float32 matmul timed on the same thread and device, at the first call too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch
from torch.utils.flop_counter import FlopCounterMode

T = TypeVar("T")
PEAK_SIZE = 1024  # the timed matmul's side: big enough to reach the BLAS's speed
PEAK_REPEATS = 5


class FlopMeter:
    """Counts the first update's FLOPs and the peak; then MFU per call from its work."""

    def __init__(self) -> None:
        self.per_unit: float | None = None  # FLOPs per unit of work, once counted
        self.peak: float | None = None  # FLOP/s

    def measure(
        self, call: Callable[[], T], work: Callable[[], float], device: torch.device
    ) -> tuple[T, float | None]:
        """``call()``'s result and the MFU it achieved (None until it can be said):
        ``work()`` is read after the call (the units it did)."""
        if self.per_unit is None:
            with FlopCounterMode(display=False) as counter:
                result = call()
            units = work()
            if units > 0:
                self.per_unit = counter.get_total_flops() / units
                self.peak = matmul_peak(device)
            return result, None
        started = time.perf_counter()
        result = call()
        elapsed = time.perf_counter() - started
        if not self.peak or elapsed <= 0:
            return result, None
        return result, self.per_unit * work() / elapsed / self.peak


def matmul_peak(device: torch.device) -> float:
    """FLOP/s of a float32 matmul of PEAK_SIZE² on ``device`` (this thread's torch threads
    on the CPU), the best of PEAK_REPEATS."""
    a = torch.randn(PEAK_SIZE, PEAK_SIZE, device=device)
    b = torch.randn(PEAK_SIZE, PEAK_SIZE, device=device)
    best = float("inf")
    for _ in range(PEAK_REPEATS + 1):  # the first warms up
        _synchronize(device)
        started = time.perf_counter()
        torch.mm(a, b)
        _synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * PEAK_SIZE**3 / best


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
