"""Shared libraries a run's set-up will load, mapped early without holding the GIL.

CPython loads an extension module's library (``dlopen``) while holding the GIL, and a
big one keeps every other thread waiting throughout: the first torch optimizer imports
``torch._dynamo``, which imports triton, whose ``libtriton.so`` (LLVM inside) takes
50-90 ms to map and relocate. On a lane thread during set-up, that is how long an
embedding host's event loop could not wake (``python -m benchmarks.host_lag
--explain``: "GIL wait, during setup", 30-110 ms). Called through ctypes, ``dlopen``
runs with the GIL released; once mapped, the import's own ``dlopen`` finds it loaded
and returns at once (the host's longest wait during the import: ~8 ms).

:func:`preload` runs first on each lane thread (corun/execution/compute.py), before the
trainer's set-up, once per process; it does nothing without torch, once the libraries
are loaded, or when they are not installed.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import threading
from pathlib import Path

# (top-level package, the library inside it, the module that loads it)
LIBRARIES = [("triton", "_C/libtriton*.so", "triton._C.libtriton")]

_lock = threading.Lock()
_done = False


def preload() -> None:
    """Map the :data:`LIBRARIES` that are installed and not yet imported, GIL released."""
    global _done
    with _lock:
        if _done:
            return
        _done = True
        if "torch" not in sys.modules or not hasattr(os, "RTLD_NOW"):
            return  # no torch optimizer will import them (or no dlopen: Windows)
        for package, pattern, module in LIBRARIES:
            if module not in sys.modules:
                for path in _installed(package, pattern):
                    _dlopen(path)


def _installed(package: str, pattern: str) -> list[Path]:
    """The library files of ``package`` matching ``pattern``, without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [p for d in spec.submodule_search_locations for p in Path(d).glob(pattern)]


def _dlopen(path: Path) -> None:
    """``dlopen`` through ctypes, which releases the GIL for a foreign call. The handle
    is kept (never closed): the import loads the same library again."""
    libc = ctypes.CDLL(None)
    libc.dlopen.restype = ctypes.c_void_p
    libc.dlopen.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.dlopen(os.fsencode(path), os.RTLD_NOW)  # a failure is the import's to report
