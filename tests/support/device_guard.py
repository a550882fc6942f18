"""A guard that records where corun's and the trainers' own code makes a tensor without
naming the run's device, or moves one to the CPU: on a CPU-only machine the run's
device *is* the CPU, so such a tensor computes here, and would meet GPU tensors (an
error, or a silent copy each step) on a GPU.

It wraps torch's factory functions and ``Tensor.to``/``Tensor.cpu`` for as long as it
is entered, in every thread (a ``TorchFunctionMode`` is thread-local, and the train
lane is a thread of its own). A call is attributed to its immediate caller: only calls
made from corun/ or trainers/ count, not those torch or a library makes.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
OURS = (ROOT / "corun", ROOT / "trainers")
# Factories that take a device= (the *_like ones follow their argument's device).
FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
    "randint", "randperm", "eye", "linspace",
)  # fmt: skip
Site = tuple[str, str, str]  # (path under the repository, function, what was called)


class DeviceGuard:
    """The call sites seen while entered (see :func:`guarding`)."""

    def __init__(self) -> None:
        self.sites: set[Site] = set()
        self._lock = threading.Lock()

    def note(self, what: str) -> None:
        frame = sys._getframe(2)  # the wrapper's caller
        path = Path(frame.f_code.co_filename)
        if not any(path.is_relative_to(root) for root in OURS):
            return
        site = (str(path.relative_to(ROOT)), frame.f_code.co_name, what)
        with self._lock:
            self.sites.add(site)


def _moves_to_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, str | torch.device):
        return torch.device(target).type == "cpu"
    return False


@contextmanager
def guarding() -> Iterator[DeviceGuard]:
    """Record, until exit, every factory call without ``device=`` and every move to the
    CPU that corun's or a trainer's code makes."""
    guard = DeviceGuard()
    saved: dict[str, Callable[..., Any]] = {name: getattr(torch, name) for name in FACTORIES}
    to, cpu = torch.Tensor.to, torch.Tensor.cpu

    def factory(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def made(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("device") is None:
                guard.note(f"torch.{name} without device")
            return original(*args, **kwargs)

        return made

    def moved_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _moves_to_cpu(args, kwargs):
            guard.note("Tensor.to(cpu)")
        return to(self, *args, **kwargs)

    def moved_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        guard.note("Tensor.cpu()")
        return cpu(self, *args, **kwargs)

    try:
        for name, original in saved.items():
            setattr(torch, name, factory(name, original))
        torch.Tensor.to, torch.Tensor.cpu = moved_to, moved_cpu  # type: ignore[method-assign,assignment]
        yield guard
    finally:
        for name, original in saved.items():
            setattr(torch, name, original)
        torch.Tensor.to, torch.Tensor.cpu = to, cpu  # type: ignore[method-assign]
