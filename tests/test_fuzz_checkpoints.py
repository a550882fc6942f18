"""Fuzzing checkpoints: ``trainer.pt`` truncated or with flipped bytes, tampered tensors
(wrong shapes and dtypes, missing and extra keys, values that are not tensors),
``state.json`` damaged, of another format, or tampered; pickle payloads that would
run code if unpickled.

``checkpoint.read`` is fuzzed in process (many examples), the resume path through
``corun.run`` with a fake trainer, and a few real ``corun train`` resumes. A bad
checkpoint is one :class:`CheckpointError` line naming the file (exit 2), never a
training error or a hang, and nothing in it is ever unpickled.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import corun
from corun.base.errors import CheckpointError, UsageError
from corun.records import checkpoint
from tests.support import fuzz_support as fuzz
from tests.support.cli import FAKE, assert_usage_error, base_toml
from tests.support.fakes import FakeTrainer
from tests.support.fuzz_support import FUZZ, assert_one_line, bounded, count


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fake trainer's run directory after two steps, saved at each."""
    run_dir = tmp_path_factory.mktemp("fuzz-ckpt") / "run"
    config = resume_config(run_dir, steps=2)
    assert anyio.run(corun.run, FakeTrainer(config), config).reason == "done"
    return run_dir


def resume_config(run_dir: Path, steps: int = 3) -> corun.Config:
    return corun.config_from_dict({
        "run": {"dir": str(run_dir), "steps": steps}, "loop": {"save_interval": 1},
        "log": {"progress": "off"}, "trainer": {"kind": FAKE, "micro_batches": 1},
    })  # fmt: skip


def copy_latest(trained: Path, into: Path, whole: bool = True) -> Path:
    """A copy of the run directory (or of its latest checkpoint only); that checkpoint."""
    shutil.rmtree(into, ignore_errors=True)
    source = trained if whole else checkpoint.latest(trained)
    assert source is not None
    shutil.copytree(source, into)
    return (checkpoint.latest(into) if whole else into) or into


def read_checked(path: Path) -> tuple[checkpoint.TrainerState, Any] | None:
    """``checkpoint.read``, or None after checking its error names one of the files."""
    try:
        with bounded(15):
            return checkpoint.read(path)
    except CheckpointError as exc:
        message = str(exc)
        assert_one_line(message)
        assert str(path / checkpoint.STATE_FILE) in message or str(path) in message, message
        return None


# ----------------------------------------------------------------------------- damaged files


@settings(FUZZ, max_examples=120)
@given(
    cut=st.floats(0, 1, exclude_max=True),
    flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), max_size=3),
)
def test_damaged_tensor_file(
    tmp_path: Path, trained: Path, cut: float, flips: list[tuple[float, int]]
) -> None:
    count("checkpoint/trainer.pt-bytes")
    latest = copy_latest(trained, tmp_path / "ckpt", whole=False)
    tensors = latest / checkpoint.TENSORS_FILE
    data = bytearray(tensors.read_bytes())
    for where, mask in flips:
        data[int(where * len(data))] ^= mask
    if not flips or cut > 0.5:  # else only the flips
        data = data[: int(cut * len(data))]
    tensors.write_bytes(bytes(data))
    loaded = read_checked(latest)
    if loaded is not None:
        assert isinstance(loaded[1]["trainer"], dict)


FORMATS = [0, 1, 2, 3, 4, -1, 2**70, "3", None, 3.0, True]


@settings(FUZZ, max_examples=200)
@given(
    how=st.sampled_from(["cut", "field", "drop", "extra", "format", "bytes", "value"]),
    cut=st.floats(0, 1),
    field=st.sampled_from(sorted(checkpoint.TrainerState.__struct_fields__)),
    value=fuzz.json_values,
    fmt=st.sampled_from(FORMATS),
    raw=st.binary(max_size=40),
)
def test_damaged_state_file(
    tmp_path: Path, trained: Path, how: str, cut: float, field: str, value: Any, fmt: Any,
    raw: bytes,
) -> None:  # fmt: skip
    count("checkpoint/state.json")
    latest = copy_latest(trained, tmp_path / "ckpt", whole=False)
    path = latest / checkpoint.STATE_FILE
    text = path.read_bytes()
    state = json.loads(text)
    if how == "cut":
        data = text[: int(cut * len(text))]
    elif how == "bytes":
        data = raw
    elif how == "value":
        data = json.dumps(value).encode()
    else:
        if how == "field":
            state[field] = value
        elif how == "drop":
            state.pop(field)
        elif how == "extra":
            state[str(value)[:10] + "_"] = value
        else:
            state["format"] = fmt
        data = json.dumps(state).encode()
    path.write_bytes(data)
    loaded = read_checked(latest)
    if loaded is not None:
        assert isinstance(loaded[0], checkpoint.TrainerState)


# ----------------------------------------------------------------------------- tampered tensors


REPLACEMENTS: dict[str, Any] = {"scalar": 3, "string": "not a tensor", "none": None, "list": [1, 2]}


def tamper(tree: dict[str, Any], where: list[str | int], how: str, dtype: torch.dtype) -> None:
    """Change the value at ``where`` in the loaded checkpoint dict."""
    parent: Any = tree
    for key in where[:-1]:
        parent = parent[key]
    key = where[-1]
    old = parent[key]
    if how == "delete":
        del parent[key]
    elif how == "shape":
        parent[key] = torch.zeros((*getattr(old, "shape", ()), 2))
    elif how == "dtype":
        parent[key] = torch.as_tensor(old).to(dtype) if torch.is_tensor(old) else torch.ones(1)
    elif how in REPLACEMENTS:
        parent[key] = REPLACEMENTS[how]
    else:  # "extra"
        parent[f"{key}_extra"] = torch.zeros(2)


# Places in the trainer's tensors to damage (the optimizer's state: OPTIMIZER_CASES).
PLACES: list[list[str | int]] = [
    ["trainer"], ["kept"], ["trainer", "model"], ["trainer", "model", "weight"],
    ["trainer", "model", "bias"], ["trainer", "extra"],
]  # fmt: skip
SAFE_HOW = ["delete", "shape", "scalar", "string", "none", "list", "extra"]
DTYPES = [torch.float64, torch.float16, torch.int64, torch.bool, torch.uint8]


@settings(FUZZ, max_examples=40)
@given(
    changes=st.lists(
        st.tuples(
            st.sampled_from(PLACES), st.sampled_from([*SAFE_HOW, "dtype"]), st.sampled_from(DTYPES)
        ),
        min_size=1,
        max_size=2,
    )
)
def test_tampered_tensors_on_resume(
    tmp_path: Path, trained: Path, changes: list[tuple[list[str | int], str, torch.dtype]]
) -> None:
    """Resuming from tampered tensors: refused with one line, or (a harmless change,
    e.g. an extra key or a castable dtype) resumed to the end; never a training error."""
    count("checkpoint/tampered-tensors")
    resume_tampered(tmp_path, trained, changes)


def resume_tampered(
    tmp_path: Path, trained: Path, changes: list[tuple[list[str | int], str, torch.dtype]]
) -> None:
    run_dir = tmp_path / "run"
    latest = copy_latest(trained, run_dir)
    tensors = latest / checkpoint.TENSORS_FILE
    tree = torch.load(tensors, weights_only=True)
    for where, how, dtype in changes:
        try:
            tamper(tree, where, how, dtype)
        except (KeyError, IndexError, TypeError):  # an earlier change removed the place
            pass
    torch.save(tree, tensors)
    config = resume_config(run_dir)
    try:
        with bounded(30):
            outcome = anyio.run(corun.run, FakeTrainer(config), config)
    except UsageError as exc:
        assert_one_line(str(exc))
        return
    assert outcome.reason == "done"


OPTIMIZER_STATE: list[str | int] = ["trainer", "optimizer", "state"]
OPTIMIZER_GROUP: list[str | int] = ["trainer", "optimizer", "param_groups", 0]
OPTIMIZER_CASES: list[tuple[str, list[str | int], str]] = [
    ("optimizer-a-tensor", ["trainer", "optimizer"], "shape"),  # AttributeError in load
    ("state-entry-a-tensor", [*OPTIMIZER_STATE, 0], "shape"),  # AttributeError in load
    ("exp_avg-wrong-shape", [*OPTIMIZER_STATE, 0, "exp_avg"], "shape"),  # the first step fails
    ("exp_avg-missing", [*OPTIMIZER_STATE, 0, "exp_avg"], "delete"),
    ("step-not-a-scalar", [*OPTIMIZER_STATE, 1, "step"], "shape"),
    ("lr-a-string", [*OPTIMIZER_GROUP, "lr"], "string"),
    ("lr-missing", [*OPTIMIZER_GROUP, "lr"], "delete"),
]


@pytest.mark.parametrize(
    ("where", "how"), [pytest.param(w, h, id=n) for n, w, h in OPTIMIZER_CASES]
)
def test_tampered_optimizer_state_on_resume(
    tmp_path: Path, trained: Path, where: list[str | int], how: str
) -> None:
    count("checkpoint/tampered-tensors")
    resume_tampered(tmp_path, trained, [(where, how, torch.float64)])


# ----------------------------------------------------------------------------- pickle payloads


class Payload:
    """Runs ``call(*args)`` when unpickled."""

    def __init__(self, call: Any, *args: Any) -> None:
        self.call, self.args = call, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.call, self.args


def payloads(marker: Path) -> dict[str, Any]:
    return {
        "os.system": Payload(os.system, f"touch {marker}"),
        "builtins.open": Payload(builtins.open, str(marker), "w"),
        "builtins.exec": Payload(builtins.exec, f"open({str(marker)!r}, 'w').close()"),
        "subprocess.call": Payload(subprocess.call, ["touch", str(marker)]),
        "pathlib.touch": Payload(Path.touch, marker),
    }


@pytest.mark.parametrize("how", ["torch.save", "raw-pickle", "beside-real-tensors"])
@pytest.mark.parametrize(
    "name", ["os.system", "builtins.open", "builtins.exec", "subprocess.call", "pathlib.touch"]
)
def test_pickle_payload_is_never_run(tmp_path: Path, trained: Path, how: str, name: str) -> None:
    count("checkpoint/pickle-payload")
    marker = tmp_path / "pwned-marker"
    payload = payloads(marker)[name]
    latest = copy_latest(trained, tmp_path / "ckpt", whole=False)
    tensors = latest / checkpoint.TENSORS_FILE
    if how == "raw-pickle":
        tensors.write_bytes(pickle.dumps({"trainer": {"x": payload}}, protocol=2))
    elif how == "torch.save":
        torch.save({"trainer": payload}, tensors)
    else:
        tree = torch.load(tensors, weights_only=True)
        tree["trainer"]["model"]["hook"] = payload
        torch.save(tree, tensors)
    with pytest.raises(CheckpointError) as caught:
        checkpoint.read(latest)
    assert_one_line(str(caught.value), str(tensors))
    assert not marker.exists(), f"{name} ran: the checkpoint was unpickled"
    with contextlib.suppress(Exception):  # what a load that unpickles would have done:
        torch.load(tensors, weights_only=False)
    assert marker.exists(), "the payload is not live: the test would prove nothing"


# ----------------------------------------------------------------------------- inconsistent state

INCONSISTENT = [
    ("negative-step", {"step": -5}),
    ("step-not-its-directory", {"step": 0}),
    ("version-above-step", {"version": 5}),
    ("negative-cursor", {"data_cursor": -1}),
    ("cursor-beyond-step", {"data_cursor": 2**70}),
    ("trained-ahead-below-cursor", {"trained_ahead": [0, 1, 2]}),
]


@pytest.mark.parametrize("change", [pytest.param(c, id=n) for n, c in INCONSISTENT])
def test_inconsistent_state_is_refused(
    tmp_path: Path, trained: Path, change: dict[str, Any]
) -> None:
    count("checkpoint/inconsistent-state")
    run_dir = tmp_path / "run"
    path = copy_latest(trained, run_dir) / checkpoint.STATE_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(CheckpointError):
        checkpoint.restore_point(resume_config(run_dir))


def test_inconsistent_state_does_not_hang_a_resume(tmp_path: Path, trained: Path) -> None:
    path = copy_latest(trained, tmp_path / "run") / checkpoint.STATE_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), "step": 0}))
    config = resume_config(tmp_path / "run", steps=4)

    async def resume() -> None:
        with anyio.fail_after(2), contextlib.suppress(UsageError):
            assert (await corun.run(FakeTrainer(config), config)).reason == "done"

    anyio.run(resume)


# ----------------------------------------------------------------------------- real `corun train`

CASES = ["pickle-payload", "format-99", "wrong-shape"]


@pytest.fixture(scope="module")
def resumed(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each damage as a real ``corun train`` resume, side by side."""
    tmp = tmp_path_factory.mktemp("fuzz-ckpt-cases")
    argvs, runs = [], {}
    for case in CASES:
        run_dir = tmp / case
        latest = copy_latest(trained, run_dir)
        tensors = latest / checkpoint.TENSORS_FILE
        if case == "pickle-payload":
            torch.save({"trainer": Payload(os.system, f"touch {tmp / 'pwned-marker'}")}, tensors)
        elif case == "format-99":
            state = latest / checkpoint.STATE_FILE
            state.write_text(json.dumps({**json.loads(state.read_text()), "format": 99}))
        else:
            tree = torch.load(tensors, weights_only=True)
            tree["trainer"]["model"]["weight"] = torch.zeros(3, 3)
            torch.save(tree, tensors)
        config = tmp / f"{case}.toml"
        config.write_text(base_toml(run_dir).replace("steps = 2", "steps = 4"))
        argvs.append(["train", str(config)])
        runs[case] = (run_dir, fuzz.tree_hash(run_dir))
    results = fuzz.corun_many(tmp, *argvs)
    return {
        case: (*runs[case], *result, fuzz.tree_hash(runs[case][0]))
        for case, result in zip(CASES, results, strict=True)
    } | {"marker": (tmp / "pwned-marker").exists()}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_corun_train_refuses_bad_checkpoint(resumed: dict[str, Any], case: str) -> None:
    count("checkpoint/subprocess")
    run_dir, before, code, _, err, after = resumed[case]
    line = assert_usage_error(code, err)
    assert str(run_dir) in line, line
    assert not resumed["marker"], "the pickle payload ran"
    assert after == before, "a refused resume changed its run directory"
