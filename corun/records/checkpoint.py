"""Checkpoints: ``<run dir>/checkpoints/step-<N>/``, written atomically, loaded safely.

A checkpoint is written under a temporary name and renamed into place after every
file is flushed to disk, so a crash mid-write never leaves a directory that looks
complete. Under torchrun with a sharded model (``run.parallel = "fsdp"``) every
rank writes its shards into the same temporary directory (``shards/``,
corun/records/shards.py) and rank 0 renames it once all have. It holds the trainer's
tensors (``trainer.pt``: ``{"trainer": its state_dict, "kept": runtime-side
components}``, and with ``checkpoint.keep_rollouts`` ``"rollouts"``: the finished,
untrained batches, corun/loop/kept_rollouts.py; loaded with ``weights_only=True``: no
arbitrary objects are unpickled) and a small typed state
(``state.json``): step, version, data cursor, run id, config digest, trainer kind. No
RNG state: every draw after set-up comes from generators seeded by position
(corun/base/rng.py).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec
import torch

from corun.base.config import Config
from corun.base.errors import CheckpointError, ConfigError
from corun.execution import distributed
from corun.records import shards

CHECKPOINTS_DIR = "checkpoints"
STATE_FILE = "state.json"
TENSORS_FILE = "trainer.pt"
# 1 held global RNG states and bare trainer tensors; 2 no kind; 3 no shards/ directory
FORMAT_VERSION = 4
_READABLE = (2, FORMAT_VERSION)
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
    # `trainer.kind` of the run that wrote it: a run directory belongs to one kind
    # ("" in format 2: not checked).
    trainer_kind: str = ""
    # The learning-rate schedule's horizon in updates when saved (0: constant, or a
    # checkpoint from before it was recorded): a resume says when it moved.
    lr_horizon: int = 0


class WriteError(RuntimeError):
    """A checkpoint could not be written (disk full, I/O error); one line that says
    whether the previous checkpoint is intact."""


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


def write(
    run_dir: Path, step: int, tensors: Any, state: TrainerState, *, writes: bool = True
) -> Path | None:
    """Write one checkpoint atomically (blocking; call it off the event loop). Sharded
    tensors in ``tensors`` are written by every rank (each calls this; the others with
    ``writes`` false), the rest and the rename by the rank that ``writes``."""
    tensors, sharded = shards.split(tensors)
    root = checkpoints_dir(run_dir)
    tmp = _temporary(run_dir, step)
    if writes:  # before the shards' first collective: no rank has written yet
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    if sharded:  # returns on rank 0 once every rank's shards are on disk
        shards.save(sharded, tmp / shards.SHARDS_DIR)
    if not writes:
        return None
    final = step_dir(run_dir, step)
    _write_files(tmp, tensors, state, final)
    _fsync_dir(root)
    return final


def write_directory(final: Path, tensors: Any, state: TrainerState) -> Path:
    """Write one unsharded checkpoint atomically at ``final`` (a directory of any name:
    the training API's saved states, corun/serve/tinker/); blocking."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    _write_files(tmp, tensors, state, final)
    _fsync_dir(final.parent)
    return final


def _write_files(tmp: Path, tensors: Any, state: TrainerState, final: Path) -> None:
    """The tensors and the state into ``tmp``, flushed to disk, then renamed ``final``."""
    with open(tmp / TENSORS_FILE, "wb") as f:
        try:
            torch.save(tensors, f)
        except RuntimeError as exc:  # torch's writer hides the OSError (disk full) in here
            if isinstance(exc.__context__, OSError):
                raise exc.__context__ from None
            raise
        f.flush()
        os.fsync(f.fileno())
    with open(tmp / STATE_FILE, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(state)))
        f.flush()
        os.fsync(f.fileno())
    if final.exists():  # the same step saved again after a resume
        shutil.rmtree(final)
    os.rename(tmp, final)


def _temporary(run_dir: Path, step: int) -> Path:
    """Where step ``step`` is written before its rename: a name every rank of this launch
    agrees on (torchrun's run id), the process id outside torchrun."""
    writer = os.environ.get("TORCHELASTIC_RUN_ID") if distributed.world().parallel else None
    return checkpoints_dir(run_dir) / f".tmp-step-{step}-{writer or os.getpid()}"


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
        if found not in _READABLE:
            raise CheckpointError(
                f"{path / STATE_FILE}: checkpoint format {found}, this corun reads "
                f"formats {_READABLE[0]}-{FORMAT_VERSION}"
            )
        state = msgspec.json.decode(raw, type=TrainerState)
        _check_consistent(path, state)
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


def read_whole(path: Path) -> tuple[TrainerState, Any]:
    """:func:`read`, with sharded tensors read whole (outside a run: a warm start, an
    export; a run restores into its own shards instead)."""
    state, tensors = read(path)
    return state, shards.fill_whole(tensors, path / shards.SHARDS_DIR)


def restore_point(config: Config) -> tuple[TrainerState, Any] | None:
    """The checkpoint this run resumes from, read and checked against the run's trainer
    kind (blocking); None for a fresh start."""
    path = resume_point(config)
    if path is None:
        return None
    state, tensors = read(path)
    kind = config.trainer.kind
    if state.trainer_kind and state.trainer_kind != kind:
        raise CheckpointError(
            f"{path}: a checkpoint of trainer kind {state.trainer_kind!r}, not {kind!r}: "
            "a run directory belongs to one trainer kind; to start from these weights, "
            f"set trainer.init_from = {str(path)!r} in a new run.dir"
        )
    return state, tensors


def check_writable(run_dir: Path) -> None:
    """Refuse, before anything is written, a run directory that cannot be written."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    for place in (existing, checkpoints_dir(run_dir)):
        if place.exists() and not (place.is_dir() and os.access(place, os.W_OK | os.X_OK)):
            why = "not a directory" if not place.is_dir() else "not writable"
            raise ConfigError(f"`$.run.dir` = {str(run_dir)!r}: {place} is {why}")


def write_failed(run_dir: Path, step: int, exc: OSError) -> WriteError:
    """The error of a failed write, once its partial files are gone and the previous
    checkpoint has been read back whole. Only this write's files: an earlier save may
    still be writing its own (writes run in the background and can overlap)."""
    shutil.rmtree(_temporary(run_dir, step), ignore_errors=True)
    why = exc.strerror or str(exc)
    previous = latest(run_dir)
    if previous is None:
        kept = "no earlier checkpoint"
    else:
        try:
            read(previous)
            kept = f"{previous.name} is intact (resume from it with checkpoint.resume=true)"
        except CheckpointError as damaged:
            kept = f"the previous one is damaged too: {damaged}"
    return WriteError(f"checkpoint step-{step} not written ({why}); {kept}")


def _check_consistent(path: Path, state: TrainerState) -> None:
    """Counters that contradict each other or the directory's name: damage (a resume
    from them would wait for data indexes that never come)."""
    named = _STEP_DIR.match(path.name)
    ahead = state.trained_ahead
    problems = [
        (min(state.step, state.version, state.data_cursor) < 0, "negative counters"),
        (named is not None and int(named[1]) != state.step, f"step {state.step} in {path.name}"),
        (state.version > state.step, f"version {state.version} above step {state.step}"),
        (
            any(i <= state.data_cursor for i in ahead) or len(set(ahead)) != len(ahead),
            "trained_ahead not above the data cursor, or repeated",
        ),
        (
            state.data_cursor + len(ahead) > state.step,  # one data index per step
            f"data cursor {state.data_cursor} + {len(ahead)} ahead beyond step {state.step}",
        ),
    ]
    for found, why in problems:
        if found:
            raise CheckpointError(f"{path / STATE_FILE}: damaged checkpoint state: {why}")


def check_optimizers(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Raise ValueError for the first just-loaded optimizer state that cannot be stepped."""
    for optimizer in optimizers:
        damage = optimizer_damage(optimizer)
        if damage:
            raise ValueError(damage)


def optimizer_damage(optimizer: torch.optim.Optimizer) -> str:
    """What in a just-loaded optimizer state cannot be stepped ("" if nothing):
    torch's load_state_dict checks the parameter counts, not the state's contents."""
    for group in optimizer.param_groups:
        for key, default in optimizer.defaults.items():
            value = group.get(key, _MISSING)
            if value is _MISSING:
                return f"param group without {key!r}"
            numbers = (int, float, torch.Tensor)
            if isinstance(default, numbers) and not isinstance(value, numbers):
                return f"param group {key!r} = {value!r}, not a number"
    states = [(p, optimizer.state[p]) for g in optimizer.param_groups for p in g["params"]]
    keys = [set(state) for _, state in states if state]
    if any(k != keys[0] for k in keys):
        return "parameter states with different entries"
    for param, state in states:
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            wrong_shape = value.dim() > 0 and value.shape != param.shape
            if wrong_shape or (key == "step" and value.numel() != 1):
                shapes = f"{tuple(value.shape)} for a parameter of {tuple(param.shape)}"
                return f"optimizer state {key!r} of shape {shapes}"
    return ""


_MISSING = object()


def latest(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None
