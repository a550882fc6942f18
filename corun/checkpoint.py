"""Checkpoints: ``<run dir>/checkpoints/step-<N>/``, written atomically, loaded safely.

A checkpoint is written under a temporary name and renamed into place after every
file is flushed to disk, so a crash mid-write never leaves a directory that looks
complete. It holds the trainer's tensors (``trainer.pt``, loaded with
``weights_only=True``: no arbitrary objects are unpickled) and a small typed state
(``state.json``): step, version, data cursor, RNG states, run id, config digest.
"""

from __future__ import annotations

import base64
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from corun.config import Config
from corun.errors import CheckpointError

CHECKPOINTS_DIR = "checkpoints"
STATE_FILE = "state.json"
TENSORS_FILE = "trainer.pt"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")


class RngState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    python: list[Any]
    numpy: list[Any]
    torch: str  # base64 of torch.get_rng_state()


class TrainerState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the runtime needs besides the trainer's tensors to continue a run exactly."""

    format: int
    step: int  # optimizer steps completed
    version: int  # weight version (== step for one update per step)
    data_cursor: int  # lowest data index not trained yet
    rng: RngState
    run_id: str  # also the wandb run id, reattached on resume
    config_digest: str
    # Indexes above the cursor already trained (completion-order consumption only).
    trained_ahead: list[int] = []


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's global RNGs, as ``run`` does before set-up."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng() -> RngState:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    assert isinstance(keys, np.ndarray)
    return RngState(
        python=[version, list(internal), gauss],
        numpy=[name, keys.tolist(), pos, has_gauss, cached],
        torch=base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    )


RawRng = tuple[Any, Any, torch.Tensor]


def capture_rng_raw() -> RawRng:
    """The global RNG states as the libraries give them: cheap enough to take every step."""
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def restore_rng_raw(raw: RawRng) -> None:
    python, numpy, torch_state = raw
    random.setstate(python)
    np.random.set_state(numpy)
    torch.set_rng_state(torch_state)


def restore_rng(state: RngState) -> None:
    version, internal, gauss = state.python
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state.numpy
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    raw = np.frombuffer(base64.b64decode(state.torch), dtype=np.uint8).copy()
    torch.set_rng_state(torch.from_numpy(raw))


def snapshot(tree: Any) -> Any:
    """A deep copy with every tensor detached and cloned to CPU, safe to write later."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {key: snapshot(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(snapshot(value) for value in tree)
    return tree


# ----------------------------------------------------------------------------- layout


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / CHECKPOINTS_DIR


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step-{step}"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (renamed into place), oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and (entry / STATE_FILE).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def remove_partial_writes(run_dir: Path) -> None:
    """Delete temporary directories left by a write that never finished."""
    root = checkpoints_dir(run_dir)
    if root.is_dir():
        for entry in root.iterdir():
            if entry.name.startswith(".tmp-"):
                shutil.rmtree(entry, ignore_errors=True)


def resume_point(config: Config) -> Path | None:
    """The checkpoint this run resumes from, or None for a fresh start.

    Refuses to start fresh over existing checkpoints: that would mix two runs'
    files in one directory.
    """
    resume = config.checkpoint.resume
    run_dir = config.run_dir
    if isinstance(resume, str):
        path = Path(resume)
        if not (path / STATE_FILE).is_file():
            raise CheckpointError(f"checkpoint.resume = {resume!r}: not a checkpoint directory")
        return path
    existing = list_checkpoints(run_dir)
    if resume:
        return existing[-1][1] if existing else None
    if existing:
        raise CheckpointError(
            f"{run_dir} already holds checkpoints; set checkpoint.resume=true to continue "
            "or choose another run.dir"
        )
    return None


# ----------------------------------------------------------------------------- write / read


def write(run_dir: Path, step: int, tensors: Any, state: TrainerState) -> Path:
    """Write one checkpoint atomically (blocking; call it off the event loop)."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step-{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with open(tmp / TENSORS_FILE, "wb") as f:
        torch.save(tensors, f)
        f.flush()
        os.fsync(f.fileno())
    with open(tmp / STATE_FILE, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(state)))
        f.flush()
        os.fsync(f.fileno())
    final = step_dir(run_dir, step)
    if final.exists():  # the same step saved again after a resume
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune(run_dir: Path, keep: int) -> None:
    if keep > 0:
        for _, path in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)


def read(path: Path) -> tuple[TrainerState, Any]:
    """Load and validate a checkpoint; any damage is a CheckpointError naming the file."""
    try:
        state = msgspec.json.decode((path / STATE_FILE).read_bytes(), type=TrainerState)
    except OSError as exc:
        raise CheckpointError(f"{path / STATE_FILE}: cannot read ({exc.strerror})") from None
    except msgspec.DecodeError as exc:
        raise CheckpointError(f"{path / STATE_FILE}: damaged checkpoint state: {exc}") from None
    if state.format != FORMAT_VERSION:
        raise CheckpointError(f"{path / STATE_FILE}: unsupported format {state.format}")
    try:
        tensors = torch.load(path / TENSORS_FILE, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path / TENSORS_FILE}: missing") from None
    except Exception as exc:  # torch raises many types for a truncated or foreign file
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path / TENSORS_FILE}: damaged checkpoint: {first_line}") from None
    return state, tensors


def latest(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None
