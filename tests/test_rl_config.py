"""Bad input to the RL trainers (GRPO, PPO) → exit status 2, one line naming the place.

In-process through ``corun.host.cli.main``, like tests/test_cli.py: config values the
trainer's Config refuses, and warm starts (``trainer.init_from``) from something that
is not a TinyLM policy checkpoint.
"""

from __future__ import annotations

import logging
import shutil
import signal
from pathlib import Path

import pytest

from corun.host import cli
from corun.records import checkpoint
from tests.support.cli import FAKE, assert_usage_error, call_main

# cli.main installs signal handlers and may configure logging: undone after each test.
pytestmark = pytest.mark.usefixtures("restore_process_state")

KINDS = ["grpo", "ppo"]


def rl_toml(run_dir: Path, kind: str) -> str:
    """A tiny one-step run: small model, small eval set, two prompts per batch."""
    return (
        f'[run]\ndir = "{run_dir}"\nsteps = 1\n\n'
        '[log]\nprogress = "off"\n\n'
        "[data]\nbatch_size = 2\n\n"
        f'[trainer]\nkind = "{kind}"\nd_model = 32\nn_heads = 2\nn_layers = 1\neval_size = 8\n'
    )


def write_config(tmp_path: Path, kind: str) -> Path:
    cfg = tmp_path / f"{kind}.toml"
    cfg.write_text(rl_toml(tmp_path / "run", kind))
    return cfg


# ----------------------------------------------------------------------------- config values

CONFIG_CASES = [
    # (id, overrides, places the line names, kinds)
    ("unknown-task", ["trainer.task=nope"], ["`$.trainer.task`", "nope"], KINDS),
    ("unknown-loss-agg", ["trainer.loss_agg=mean"], ["`$.trainer.loss_agg`", "mean"], KINDS),
    # A shape the model cannot build is refused at load, not at set-up.
    ("heads-do-not-divide", ["trainer.d_model=31"], ["`$.trainer.d_model`"], KINDS),
    (
        "grpo-one-sample",
        ["trainer.samples_per_prompt=1"],
        ["`$.trainer.samples_per_prompt`", "trainer.samples_per_prompt=1"],
        ["grpo"],
    ),
    ("negative-lr", ["trainer.lr=-0.001"], ["`$.trainer.lr`"], KINDS),
    ("zero-lr", ["trainer.lr=0"], ["`$.trainer.lr`"], KINDS),
    ("top-p-zero", ["trainer.top_p=0"], ["`$.trainer.top_p`"], KINDS),
    ("top-p-above-one", ["trainer.top_p=1.5"], ["`$.trainer.top_p`"], KINDS),
    ("negative-clip", ["trainer.clip_high=-0.1"], ["`$.trainer.clip_high`"], KINDS),
    ("zero-temperature", ["trainer.temperature=0"], ["`$.trainer.temperature`"], KINDS),
    (
        "truncated-reward",
        ["trainer.truncated_reward=half"],
        ["`$.trainer.truncated_reward`"],
        KINDS,
    ),
    ("ppo-gamma-above-one", ["trainer.gamma=1.5"], ["`$.trainer.gamma`"], ["ppo"]),
    ("ppo-unknown-key", ["trainer.dynamic_sampling=true"], ["dynamic_sampling"], ["ppo"]),
]


@pytest.mark.parametrize("command", ["validate", "train"])
@pytest.mark.parametrize(
    ("kind", "overrides", "places"),
    [
        pytest.param(kind, overrides, places, id=f"{name}-{kind}")
        for name, overrides, places, kinds in CONFIG_CASES
        for kind in kinds
    ],
)
def test_bad_rl_config_is_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    command: str,
    kind: str,
    overrides: list[str],
    places: list[str],
) -> None:
    cfg = write_config(tmp_path, kind)
    code, out, err = call_main([command, str(cfg), *overrides], capsys)
    assert_usage_error(code, err, str(cfg), *places)
    assert out == ""
    assert not (tmp_path / "run").exists(), "a refused config must not create its run directory"


def test_the_tiny_config_itself_is_valid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The cases above fail for their override alone."""
    for kind in KINDS:
        code, _, err = call_main(["validate", str(write_config(tmp_path, kind))], capsys)
        assert code == 0, err
    # PPO, unlike GRPO, accepts one sample per prompt.
    code, _, err = call_main(
        ["validate", str(write_config(tmp_path, "ppo")), "trainer.samples_per_prompt=1"], capsys
    )
    assert code == 0, err


@pytest.mark.parametrize(
    ("bad", "place"),
    [
        # GRPO's own check (``__post_init__``), which msgspec reports "at `$.trainer`".
        ("trainer.samples_per_prompt=1", "`$.trainer.samples_per_prompt`"),
        # An unknown key, also reported "at `$.trainer`".
        ("trainer.bogus=1", "bogus"),
    ],
)
def test_blamed_override_is_the_culprit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str, place: str
) -> None:
    """A valid override of the same table, given first, is not the one blamed."""
    cfg = write_config(tmp_path, "grpo")
    code, _, err = call_main(["validate", str(cfg), "trainer.lr=0.001", bad], capsys)
    line = assert_usage_error(code, err, place)
    assert "trainer.lr=0.001" not in line, line


# ----------------------------------------------------------------------------- warm start


@pytest.fixture(scope="module")
def fake_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``checkpoints/step-1`` of a one-step FakeTrainer run: a checkpoint, not a TinyLM."""
    root = tmp_path_factory.mktemp("fake")
    cfg = root / "fake.toml"
    cfg.write_text(
        f'[run]\ndir = "{root / "run"}"\nsteps = 1\n\n[log]\nprogress = "off"\n\n'
        f'[loop]\nsave_interval = 1\n\n[trainer]\nkind = "{FAKE}"\n'
    )
    # A module-scoped fixture runs outside the autouse one: undo cli.main's process state.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    root_logger = logging.getLogger()
    logger_handlers, logger_level = list(root_logger.handlers), root_logger.level
    try:
        assert cli.main(["train", str(cfg)]) == 0
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        root_logger.handlers[:] = logger_handlers
        root_logger.setLevel(logger_level)
    path = root / "run" / "checkpoints" / "step-1"
    assert (path / checkpoint.STATE_FILE).is_file()
    return path


def train_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, init: Path) -> str:
    cfg = write_config(tmp_path, kind)
    code, _, err = call_main(["train", str(cfg), f'trainer.init_from="{init}"'], capsys)
    return assert_usage_error(code, err, str(init))


@pytest.mark.parametrize("kind", KINDS)
def test_init_from_a_directory_that_is_not_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    train_refused(tmp_path, capsys, kind, elsewhere)


@pytest.mark.parametrize("kind", KINDS)
def test_init_from_a_missing_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    train_refused(tmp_path, capsys, kind, tmp_path / "no-such-dir")


@pytest.mark.parametrize("kind", KINDS)
def test_init_from_a_missing_toml(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    train_refused(tmp_path, capsys, kind, tmp_path / "sft" / "nope.toml")


@pytest.mark.parametrize("kind", KINDS)
def test_init_from_a_checkpoint_that_is_not_a_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, fake_checkpoint: Path
) -> None:
    line = train_refused(tmp_path, capsys, kind, fake_checkpoint)
    assert "TinyLM" in line, line


@pytest.mark.parametrize("kind", KINDS)
def test_init_from_a_checkpoint_with_garbage_tensors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, fake_checkpoint: Path
) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(fake_checkpoint, damaged)
    tensors = damaged / checkpoint.TENSORS_FILE
    tensors.write_bytes(b"this is not a torch file\x00\xff" * 10)
    line = train_refused(tmp_path, capsys, kind, damaged)
    assert str(tensors) in line, line
