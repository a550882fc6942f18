"""The run's device (``run.device``): where a trainer's models, optimizer state, batches
and losses live. Rewards, data and records stay on the CPU by design.

``"auto"`` is this process's GPU when torch sees CUDA (under torchrun each rank takes
``cuda:LOCAL_RANK``), else the CPU; ``"cuda"`` insists on a GPU and ``"cuda:N"`` names
one; ``"cpu"`` keeps a run on the CPU beside an idle GPU. A request this machine cannot
meet is refused at start, in one line naming ``run.device``.

:func:`use` resolves the setting once per run and remembers it for the process: a
trainer reads it from ``SetupContext.device``, the runtime's own pieces (the torchrun
backend, the FSDP mesh) from :func:`current`.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

from corun.base.errors import ConfigError

WHERE = "`$.run.device`"
_current: list[torch.device] = [torch.device("cpu")]


def resolve(setting: str) -> torch.device:
    """The device ``setting`` names on this machine; ConfigError when it has none."""
    if setting == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    available = torch.cuda.is_available()
    if setting == "auto":
        return torch.device("cuda", local) if available else torch.device("cpu")
    if not available:
        build = "a CPU-only build" if torch.version.cuda is None else "no GPU visible"
        raise ConfigError(
            f"{WHERE} = {setting!r}: CUDA is not available here (torch "
            f'{torch.__version__}, {build}); use run.device = "cpu" or "auto"'
        )
    index = local if setting == "cuda" else int(setting.split(":", 1)[1])
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigError(f"{WHERE} = {setting!r}: this machine has {count} GPU(s), cuda:0 to "
                          f"cuda:{count - 1}")  # fmt: skip
    return torch.device("cuda", index)


def use(setting: str) -> torch.device:
    """Resolve ``setting`` and make it the process's run device (a GPU becomes torch's
    current CUDA device, which NCCL and CUDA calls without an index use)."""
    device = resolve(setting)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _current[0] = device
    return device


def current() -> torch.device:
    """The run device of this process: the CPU before any run chose one."""
    return _current[0]


def describe(device: torch.device) -> dict[str, Any]:
    """The device, its name and memory, for the run's ``start`` event."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"device": str(device), "device_name": props.name,
                "device_memory_gib": round(props.total_memory / 2**30, 1)}  # fmt: skip
    return {"device": "cpu", "device_name": _cpu_name(),
            "device_memory_gib": _memory_gib()}  # fmt: skip


def memory_metrics(device: torch.device) -> dict[str, float]:
    """A step's ``perf/device_memory_peak_gib`` on a GPU: the most torch held on it
    since the last step (then reset); none on CPU."""
    if device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return {"perf/device_memory_peak_gib": round(peak, 3)}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return round(pages * size / 2**30, 1)
