"""Bad input to ``corun`` → exit status 2, one line naming the place, no traceback.

Config and override errors are checked in-process through ``corun.host.cli.main`` (fast);
checkpoint damage is checked against a real ``corun train`` subprocess, where any
stray warning or traceback would show on stderr. A refused run leaves its run
directory exactly as it was.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path
from typing import Any

import anyio
import pytest

import corun
from corun.records import checkpoint
from tests.support.cli import (
    FAKE,
    assert_usage_error,
    base_toml,
    call_main,
    corun_subprocess,
    listing,
)
from tests.support.fakes import FakeTrainer

REPO = Path(__file__).resolve().parents[1]
# cli.main installs signal handlers and may configure logging: undone after each test.
pytestmark = pytest.mark.usefixtures("restore_process_state")


# ----------------------------------------------------------------------------- config


CONFIG_CASES = [
    # (id, extra TOML appended to the base config, overrides, places the line names)
    ("unknown-key-in-table", "\n[loop]\nconcurency = 2\n", [], ["`$.loop`", "concurency"]),
    ("unknown-key-in-trainer", "bogus = 1\n", [], ["`$.trainer`", "bogus"]),
    ("unknown-table", "\n[lop]\nconcurrency = 2\n", [], ["lop"]),
    ("wrong-type", '\n[loop]\nsave_interval = "ten"\n', [], ["`$.loop.save_interval`"]),
    ("wrong-type-trainer", 'slow_s = "abc"\n', [], ["`$.trainer.slow_s`"]),
    ("bad-enum", "", ["run.backend=tokio"], ["`$.run.backend`", "run.backend=tokio"]),
    ("steps-negative", "", ["run.steps=-1"], ["`$.run.steps`", "run.steps=-1"]),
    ("concurrency-zero", "", ["loop.concurrency=0"], ["`$.loop.concurrency`"]),
    ("override-wrong-type", "", ["run.steps=ten"], ["`$.run.steps`", "run.steps=ten"]),
    ("override-no-equals", "", ["loopconcurrency2"], ["'loopconcurrency2'", "KEY.PATH=VALUE"]),
    ("override-no-key", "", ["=3"], ["'=3'", "KEY.PATH=VALUE"]),
    ("override-empty-part", "", ["loop..concurrency=3"], ["'loop..concurrency=3'"]),
    ("override-unknown-path", "", ["loop.nope=1"], ["`$.loop`", "nope"]),
    ("override-into-value", "", ["run.steps.x=1"], ["`$.run.steps`", "run.steps.x=1"]),
    ("override-table-with-value", "", ["loop=3"], ["`$.loop`"]),
    (
        "max-staleness-below-sync-interval",
        "",
        ["loop.sync_interval=4", "loop.max_staleness=2"],
        ["`$.loop`", "max_staleness"],
    ),
    (
        "unknown-trainer-name",
        "",
        ["trainer.kind=no_such_trainer"],
        ["`$.trainer.kind`", "no_such_trainer"],
    ),
    (
        "unknown-trainer-module",
        "",
        ["trainer.kind=no_such_mod:X"],
        ["`$.trainer.kind`", "no_such_mod"],
    ),
    ("not-a-trainer", "", ["trainer.kind=corun.base.config:Config"], ["`$.trainer.kind`"]),
    (
        "eval-interval-off-window",
        "",
        ["loop.accumulate=2", "loop.eval_interval=3"],
        ["`$.loop`", "eval_interval", "accumulate"],
    ),
    ("steps-off-window", "", ["loop.accumulate=2", "run.steps=3"], ["`$.run.steps`"]),
    (
        "mini-batches-unsupported",  # a trainer that owns its update (train_step)
        "",
        ["trainer.kind=tests.test_admission:LatencyTrainer", "loop.mini_batches=2"],
        ["`$.loop.mini_batches`", "train_step"],
    ),
    (
        "fixed-schedule-completion-order",
        "",
        ["loop.version_schedule=fixed", "loop.order=completion"],
        ["`$.loop`", "version_schedule", "order"],
    ),
]


@pytest.mark.parametrize("command", ["validate", "train"])
@pytest.mark.parametrize(
    ("extra", "overrides", "places"),
    [pytest.param(extra, ov, places, id=name) for name, extra, ov, places in CONFIG_CASES],
)
def test_bad_config_is_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    command: str,
    extra: str,
    overrides: list[str],
    places: list[str],
) -> None:
    run_dir = tmp_path / "run"
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(base_toml(run_dir, extra))
    code, out, err = call_main([command, str(cfg), *overrides], capsys)
    assert_usage_error(code, err, *places)
    assert out == ""
    assert not run_dir.exists(), "a refused run must not create its run directory"


def test_wrong_type_in_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(base_toml(tmp_path / "run").replace("steps = 2", 'steps = "ten"'))
    code, _, err = call_main(["train", str(cfg)], capsys)
    assert_usage_error(code, err, str(cfg), "`$.run.steps`")
    assert not (tmp_path / "run").exists()


def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.toml"
    code, _, err = call_main(["train", str(missing)], capsys)
    assert_usage_error(code, err, str(missing), "not found")


def test_malformed_toml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(base_toml(tmp_path / "run") + "[loop\nconcurrency = 2\n")
    code, _, err = call_main(["validate", str(cfg)], capsys)
    assert_usage_error(code, err, str(cfg), "line")


def test_config_is_not_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "cfg.toml"
    cfg.write_bytes(b"\xff\xfe\x00binary")
    code, _, err = call_main(["validate", str(cfg)], capsys)
    assert_usage_error(code, err, str(cfg))


def test_config_is_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = call_main(["validate", str(tmp_path)], capsys)
    assert_usage_error(code, err, str(tmp_path))


def test_missing_trainer_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'[run]\ndir = "{tmp_path / "run"}"\nsteps = 2\n')
    code, _, err = call_main(["train", str(cfg)], capsys)
    assert_usage_error(code, err, str(cfg), "`$.trainer.kind`")


@pytest.mark.parametrize(
    ("argv", "place"),
    [
        pytest.param([], "command", id="no-command"),
        pytest.param(["frobnicate"], "frobnicate", id="unknown-command"),
        pytest.param(["train"], "config", id="no-config"),
    ],
)
def test_bad_command_line(capsys: pytest.CaptureFixture[str], argv: list[str], place: str) -> None:
    code, _, err = call_main(argv, capsys)
    assert_usage_error(code, err, place)


def test_validate_prints_toml_that_round_trips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(base_toml(tmp_path / "run", "slow_s = 0.5\n"))
    code, out, err = call_main(["validate", str(cfg), "loop.concurrency=3"], capsys)
    assert code == 0, err
    assert err == ""
    data = tomllib.loads(out)
    assert data["loop"]["concurrency"] == 3
    assert data["trainer"]["kind"] == FAKE
    assert data["trainer"]["slow_s"] == 0.5
    assert data["run"]["dir"] == str(tmp_path / "run")
    # The printed config is itself a valid config, equal to the one it came from.
    printed = tmp_path / "printed.toml"
    printed.write_text(out)
    assert corun.load_config(printed) == corun.load_config(cfg, ["loop.concurrency=3"])
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory after two steps, saved at each: checkpoints step-1 and step-2."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    config = corun.config_from_dict(
        {
            "run": {"dir": str(run_dir), "steps": 2},
            "loop": {"save_interval": 1},
            "log": {"progress": "off"},
            "trainer": {"kind": FAKE},
        }
    )
    outcome = anyio.run(corun.run, FakeTrainer(config), config)
    assert outcome.reason == "done"
    assert [step for step, _ in checkpoint.list_checkpoints(run_dir)] == [1, 2]
    return run_dir


@pytest.fixture
def copied_run(trained_run: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    return run_dir


def resume_refused(tmp_path: Path, run_dir: Path, *overrides: str) -> str:
    """``corun train`` over ``run_dir`` must refuse with exit 2 and change nothing."""
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(base_toml(run_dir).replace("steps = 2", "steps = 4"))
    before = listing(run_dir)
    result = corun_subprocess(tmp_path, "train", str(cfg), "loop.save_interval=1", *overrides)
    line = assert_usage_error(result.returncode, result.stderr)
    assert result.stdout == ""
    assert listing(run_dir) == before, "a refused run changed its run directory"
    return line


def test_truncated_checkpoint_tensors(tmp_path: Path, copied_run: Path) -> None:
    latest = checkpoint.latest(copied_run)
    assert latest is not None and latest.name == "step-2"
    tensors = latest / checkpoint.TENSORS_FILE
    data = tensors.read_bytes()
    tensors.write_bytes(data[: len(data) // 2])
    line = resume_refused(tmp_path, copied_run)
    assert str(tensors) in line, line


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda text: text[: len(text) // 2], id="truncated"),
        pytest.param(lambda text: text.replace('"step": 2', '"step": "two"'), id="wrong-type"),
        pytest.param(lambda text: "[]", id="not-an-object"),
    ],
)
def test_damaged_checkpoint_state(tmp_path: Path, copied_run: Path, damage: Any) -> None:
    latest = checkpoint.latest(copied_run)
    assert latest is not None
    state = latest / checkpoint.STATE_FILE
    text = state.read_text()
    damaged = damage(text)
    assert damaged != text
    state.write_text(damaged)
    line = resume_refused(tmp_path, copied_run)
    assert str(state) in line, line


def test_fresh_start_over_existing_checkpoints(tmp_path: Path, copied_run: Path) -> None:
    line = resume_refused(tmp_path, copied_run, "checkpoint.resume=false")
    assert str(copied_run) in line, line


def test_resume_from_a_path_that_is_not_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(base_toml(tmp_path / "run"))
    not_a_checkpoint = tmp_path / "elsewhere"
    not_a_checkpoint.mkdir()
    code, _, err = call_main(["train", str(cfg), f'checkpoint.resume="{not_a_checkpoint}"'], capsys)
    assert_usage_error(code, err, str(not_a_checkpoint))
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- recipes


def test_a_recipe_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bare name that is no file where corun runs is a shipped recipe (configs/);
    the run it warm-starts from is named by recipe name too."""
    monkeypatch.chdir(tmp_path)  # nothing of the checkout's here
    code, out, err = call_main(["validate", "grpo", "run.steps=2"], capsys)
    assert code == 0, err
    data = tomllib.loads(out)
    assert data["trainer"]["kind"] == "grpo" and data["run"]["steps"] == 2
    assert corun.load_config(data["trainer"]["init_from"]).run.name == "sft-warmup"


def test_an_unknown_recipe_is_one_line_naming_the_recipes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = call_main(["train", "no_such_recipe"], capsys)
    assert_usage_error(code, err, "no_such_recipe", "grpo", "sft_warmup")


def test_recipes_are_listed_and_copied_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = call_main(["recipes"], capsys)
    assert code == 0
    listed = dict(line.split(maxsplit=1) for line in out.splitlines())
    assert {"grpo", "sft", "agentic", "hf_grpo"} <= listed.keys()
    assert listed["sft"].startswith("Supervised fine-tuning of TinyLM")
    code, _, err = call_main(["recipes", "copy", "grpo", str(tmp_path)], capsys)
    assert code == 0, err
    copied = tmp_path / "grpo.toml"
    assert copied.read_text() == (REPO / "configs" / "grpo.toml").read_text()
    code, _, err = call_main(["recipes", "copy", "grpo", str(tmp_path)], capsys)
    assert_usage_error(code, err, str(copied))  # never over a file of one's own
    code, _, err = call_main(["recipes", "copy", "no_such_recipe"], capsys)
    assert_usage_error(code, err, "no_such_recipe", "grpo")
