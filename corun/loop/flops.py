"""``perf/mfu``: the update's model FLOP/s over the machine's matmul peak, both measured
in the same run (torchtitan's MFU).

The update's FLOPs are the model's, as torchtitan counts them: 6 x the parameters of
the modules the update trains (their frozen parts too, LoRA's base: backward runs
through them), less their input embeddings (a lookup, not a matmul), per token of the
rows the passes computed (padding included; a trainer that reports no row lengths
gets no figure). Attention's own FLOPs and activation recomputation are not counted,
so a run with activation checkpointing shows the model's rate, not the hardware's.
The peak is a square float32 matmul timed on the update's thread and device once, at
its first call (the update's threads are the lane's, fixed for the run).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch import nn

T = TypeVar("T")
PEAK_SIZE = 1024  # the timed matmul's side: large enough for the BLAS to reach its speed
PEAK_REPEATS = 5


class FlopMeter:
    """MFU of each update call from its tokens and its time."""

    def __init__(self, owner: Any, params: Iterable[nn.Parameter]) -> None:
        self.flops_per_token = 6 * model_params(owner, params)
        self.peak: float | None = None  # FLOP/s, measured at the first call

    def measure(
        self, call: Callable[[], T], tokens: Callable[[], float], device: torch.device
    ) -> tuple[T, float | None]:
        """``call()``'s result and the MFU it achieved (None without tokens to count):
        ``tokens()`` is read after the call."""
        if self.peak is None and self.flops_per_token:
            self.peak = matmul_peak(device)
        started = time.perf_counter()
        result = call()
        elapsed = time.perf_counter() - started
        done = tokens()
        if not self.peak or done <= 0 or elapsed <= 0:
            return result, None
        return result, self.flops_per_token * done / elapsed / self.peak


def model_params(owner: Any, trained: Iterable[nn.Parameter]) -> int:
    """Parameters of the modules among ``owner``'s attributes that hold a ``trained``
    parameter, less their embeddings."""
    wanted = {id(p) for p in trained}
    modules = [
        value for value in vars(owner).values()
        if isinstance(value, nn.Module) and any(id(p) in wanted for p in value.parameters())
    ]  # fmt: skip
    seen: set[int] = set()
    count = 0
    for module in modules:
        lookups = {id(p) for m in module.modules() if isinstance(m, nn.Embedding)
                   for p in m.parameters()}  # fmt: skip
        for p in module.parameters():
            if id(p) not in seen and id(p) not in lookups:
                seen.add(id(p))
                count += p.numel()
    return count


def matmul_peak(device: torch.device) -> float:
    """FLOP/s of a float32 matmul of PEAK_SIZE² on ``device`` (this thread's torch threads
    on the CPU), the best of PEAK_REPEATS."""
    generator = torch.Generator(device).manual_seed(0)  # not the global RNG's draws
    a, b = (torch.rand(PEAK_SIZE, PEAK_SIZE, device=device, generator=generator) for _ in "ab")
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
