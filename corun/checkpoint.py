"""Checkpoints: ``<run dir>/checkpoints/step-<N>/``, written atomically, loaded safely.

A checkpoint is written under a temporary name and renamed into place after every
file is flushed to disk, so a crash mid-write never leaves a directory that looks
complete. It holds the trainer's tensors (``trainer.pt``: ``{"trainer": its
state_dict, "kept": runtime-side components}``, loaded with ``weights_only=True``: no
arbitrary objects are unpickled) and a small typed state (``state.json``): step,
version, data cursor, run id, config digest. No RNG state: every draw after set-up
comes from generators seeded by position (corun/rng.py).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import msgspec
import torch

from corun.config import Config
from corun.errors import CheckpointError

CHECKPOINTS_DIR = "checkpoints"
STATE_FILE = "state.json"
TENSORS_FILE = "trainer.pt"
FORMAT_VERSION = 2  # 1 held global RNG states and bare trainer tensors
_STEP_DIR = re.compile(r"^step-(\d+)$")


class _Format(msgspec.Struct):
    format: int


class TrainerState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the runtime needs besides the trainer's tensors to continue a run exactly."""

    format: int
    step: int  # rollout batches trained
    version: int  # policy version: updates applied (step // loop.accumulate)
    data_cursor: int  # lowest data index not trained yet
    run_id: str  # also the wandb run id, reattached on resume
    config_digest: str
    # Indexes above the cursor already trained (completion-order consumption only).
    trained_ahead: list[int] = []


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
        raw = (path / STATE_FILE).read_bytes()
        # The format first: another format's fields would read as damage.
        found = msgspec.json.decode(raw, type=_Format).format
        if found != FORMAT_VERSION:
            raise CheckpointError(
                f"{path / STATE_FILE}: checkpoint format {found}, this corun reads "
                f"format {FORMAT_VERSION}"
            )
        state = msgspec.json.decode(raw, type=TrainerState)
    except OSError as exc:
        raise CheckpointError(f"{path / STATE_FILE}: cannot read ({exc.strerror})") from None
    except msgspec.DecodeError as exc:
        raise CheckpointError(f"{path / STATE_FILE}: damaged checkpoint state: {exc}") from None
    try:
        tensors = torch.load(path / TENSORS_FILE, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path / TENSORS_FILE}: missing") from None
    except Exception as exc:  # torch raises many types for a truncated or foreign file
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path / TENSORS_FILE}: damaged checkpoint: {first_line}") from None
    if not (isinstance(tensors, dict) and isinstance(tensors.get("trainer"), dict)):
        raise CheckpointError(f"{path / TENSORS_FILE}: not a corun checkpoint (no trainer state)")
    return state, tensors


def latest(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None
