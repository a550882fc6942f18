"""Fuzzing configs: TOML files (mutated tables, wrong types, unknown keys, huge numbers,
NaN/inf, deep nesting, damaged bytes) and ``KEY.PATH=VALUE`` overrides.

In process through ``corun.host.cli.main`` (``validate``: read, override, check, print):
every input gives exit 0 with TOML that reads back the same, or exit 2 with one line
naming the file and the place. Values that validate are also run (a fake trainer, two
steps): an extreme number that passes validation must not fail the run later. A few
real ``corun train`` subprocesses check the same over a trained run directory, which
must stay byte for byte as it was.
"""

from __future__ import annotations

import datetime
import math
import shutil
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import tomli_w
from hypothesis import given, settings
from hypothesis import strategies as st

import corun
from corun.base import config
from corun.base.errors import UsageError
from corun.host import cli
from tests.support.cli import FAKE, assert_usage_error, base_toml
from tests.support.fakes import FakeConfig, FakeTrainer
from tests.support.fuzz_support import FUZZ, assert_one_line, bounded, corun_many, count, tree_hash

# cli.main installs signal handlers and may configure logging: undone after each test.
pytestmark = pytest.mark.usefixtures("restore_process_state")

SECTIONS: dict[str, type[msgspec.Struct]] = {
    "run": config.RunConfig,
    "loop": config.LoopConfig,
    "checkpoint": config.CheckpointConfig,
    "log": config.LogConfig,
    "data": config.DataConfig,
    "serve": config.ServeConfig,
    "rollout": config.RolloutConfig,
    "trainer": FakeConfig,
}
FIELDS = {name: [f.name for f in msgspec.structs.fields(tp)] for name, tp in SECTIONS.items()}
EXTREME_INTS = [0, 1, -1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]
EXTREME_FLOATS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 5e-324, 1e308, -1e308]


# ----------------------------------------------------------------------------- strategies

keys = st.text(max_size=10)
scalars = st.one_of(
    st.sampled_from(EXTREME_INTS),
    st.integers(),
    st.sampled_from(EXTREME_FLOATS),
    st.floats(),
    st.text(max_size=20),
    st.booleans(),
    st.datetimes(min_value=datetime.datetime(1, 1, 1)),
    st.sampled_from(["asyncio", "trio", "fixed", "start", "thread", "off", FAKE, "sft"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
    max_leaves=6,
)


def nested(depth: int, leaf: Any = 1) -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


@st.composite
def mutated_tables(draw: st.DrawFn, run_dir: str) -> dict[str, Any]:
    """A valid config's tables with one to three mutations."""
    raw: dict[str, Any] = {
        "run": {"dir": run_dir, "steps": 2},
        "log": {"progress": "off"},
        "trainer": {"kind": FAKE},
    }
    for _ in range(draw(st.integers(1, 3))):
        section = draw(st.sampled_from(sorted(FIELDS)) | keys)
        known = FIELDS.get(section, [])
        key = draw(st.sampled_from(known) | keys) if known else draw(keys)
        how = draw(st.sampled_from(["set", "set", "set", "table", "deep", "drop"]))
        table = raw.setdefault(section, {})
        if how == "table":  # a table given as a value, or the reverse
            raw[section] = draw(values)
        elif how == "drop":
            raw.pop(section)
        elif isinstance(table, dict):
            table[key] = nested(draw(st.integers(2, 60))) if how == "deep" else draw(values)
    return raw


def toml_literal(value: Any) -> str:
    return tomli_w.dumps({"v": value}).removeprefix("v = ").strip()


known_keys = st.sampled_from([f"{s}.{k}" for s, names in FIELDS.items() for k in names])
overrides = st.one_of(
    st.builds(lambda k, v: f"{k}={toml_literal(v)}", known_keys, values),
    st.builds(lambda k, v: f"{k}={v}", known_keys | keys, st.text(max_size=20)),
    st.text(max_size=30),  # anything: missing '=', empty parts, odd characters
)


# ----------------------------------------------------------------------------- helpers


def validate(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    with bounded(20):
        try:
            code = cli.main(["validate", str(path), *extra])
        except SystemExit as exc:  # argparse's own errors
            code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def check_validate(code: int, out: str, err: str, path: Path) -> None:
    """Exit 0 with a config that reads back the same, or exit 2 with one line."""
    if code == 0:
        assert err == "", err
        printed = path.with_name("printed.toml")
        printed.write_text(out)
        assert config.to_toml(corun.load_config(printed)) == out
    else:
        line = assert_usage_error(code, err)
        assert str(path) in line or "override" in line or "(see corun --help)" in line, line


# ----------------------------------------------------------------------------- in process


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_mutated_config_tables(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], data: st.DataObject
) -> None:
    count("config/tables")
    run_dir = tmp_path / "run"
    raw = data.draw(mutated_tables(str(run_dir)))
    path = tmp_path / "cfg.toml"
    path.write_text(tomli_w.dumps(raw))
    code, out, err = validate(path, capsys)
    check_validate(code, out, err, path)
    if code == 2:
        assert "`$" in err, err  # a config key path
    assert not run_dir.exists()


@settings(FUZZ, max_examples=150)
@given(
    edits=st.lists(
        st.tuples(
            st.floats(0, 1), st.sampled_from(["insert", "delete", "replace"]), st.binary(max_size=4)
        ),
        min_size=1,
        max_size=4,
    ),
    prefix=st.sampled_from([b"", b"\xef\xbb\xbf", b"\xff\xfe", b"\x00"]),
)
def test_damaged_config_bytes(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    edits: list[tuple[float, str, bytes]],
    prefix: bytes,
) -> None:
    count("config/bytes")
    text = bytearray(base_toml(tmp_path / "run", "slow_s = 0.0\n").encode())
    for where, how, chunk in edits:
        at = int(where * len(text))
        if how == "insert":
            text[at:at] = chunk
        elif how == "delete":
            del text[at : at + max(1, len(chunk))]
        else:
            text[at : at + len(chunk)] = chunk
    path = tmp_path / "cfg.toml"
    path.write_bytes(prefix + bytes(text))
    code, out, err = validate(path, capsys)
    check_validate(code, out, err, path)


@settings(FUZZ, max_examples=40)
@given(
    depth=st.sampled_from([10, 500, 990, 1000, 3000, 100_000]),
    shape=st.sampled_from(["[", "{a = "]),
    where=st.sampled_from(["file", "override"]),
)
def test_deeply_nested_toml(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], depth: int, shape: str, where: str
) -> None:
    """tomllib parses nesting recursively: past Python's limit it raised RecursionError."""
    count("config/deep-nesting")
    closing = {"[": "]", "{a = ": "}"}[shape]
    value = shape * depth + "1" + closing * depth
    path = tmp_path / "cfg.toml"
    text = base_toml(tmp_path / "run")
    path.write_text(text + (f"deep = {value}\n" if where == "file" else ""))
    extra = [f"trainer.deep={value}"] if where == "override" else []
    code, out, err = validate(path, capsys, *extra)
    check_validate(code, out, err, path)
    assert code == 2


@settings(FUZZ, max_examples=200)
@given(chosen=st.lists(overrides, max_size=4))
def test_fuzzed_overrides(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], chosen: list[str]
) -> None:
    count("overrides")
    path = tmp_path / "cfg.toml"
    path.write_text(base_toml(tmp_path / "run"))
    code, out, err = validate(path, capsys, *chosen)
    check_validate(code, out, err, path)
    assert not (tmp_path / "run").exists()


def test_unknown_option_with_a_line_break(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    count("overrides")
    path = tmp_path / "cfg.toml"
    path.write_text(base_toml(tmp_path / "run"))
    code, _, err = validate(path, capsys, "-x\ny")
    assert_usage_error(code, err, "-x")


# ----------------------------------------------------------------------------- extremes that run

NUMERIC = [
    ("run", "seed"), ("loop", "concurrency"), ("loop", "workers"), ("loop", "lane_threads"),
    ("loop", "max_staleness"), ("loop", "sync_interval"), ("loop", "eval_interval"),
    ("loop", "save_interval"), ("checkpoint", "keep"), ("data", "batch_size"),
    ("run", "hard_deadline_s"), ("run", "collective_timeout_s"), ("serve", "max_batch"),
]  # fmt: skip


EXTREMES = [0, -1, 2**31, 2**63, 2**64, 10**30, math.nan, math.inf, -math.inf, 5e-324, 1e308]


def run_extreme(run_dir: Path, chosen: list[tuple[tuple[str, str], Any]]) -> None:
    """Validate, and run two steps of a fake trainer if valid: a UsageError or done."""
    raw: dict[str, Any] = {
        "run": {"dir": str(run_dir), "steps": 2},
        "log": {"progress": "off"},
        "loop": {"baseline_eval": False},
        "trainer": {"kind": FAKE, "micro_batches": 1},
    }
    for (section, key), value in chosen:
        raw.setdefault(section, {})[key] = value
        if key == "workers":  # at most concurrency: raise both
            raw[section]["concurrency"] = value
    try:
        cfg = corun.config_from_dict(raw)
    except UsageError as exc:
        assert_one_line(str(exc), "`$")
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    with bounded(30):
        try:
            outcome = anyio.run(corun.run, FakeTrainer(cfg), cfg)
        except UsageError as exc:
            assert_one_line(str(exc))
            return
    assert outcome.reason == "done"


def test_each_extreme_number_validates_and_runs_or_is_refused(tmp_path: Path) -> None:
    """Every numeric setting at every extreme (seed = 2**64 and lane_threads = 2**31 used
    to validate and then fail the run with a traceback; workers = 10**6 hung set-up)."""
    failed = []
    for field in NUMERIC:
        for value in EXTREMES:
            count("config/extreme-numbers")
            try:
                run_extreme(tmp_path / "run", [(field, value)])
            except Exception as exc:
                failed.append(f"{'.'.join(field)} = {value!r}: {type(exc).__name__}: {exc}")
    assert failed == []


# ----------------------------------------------------------------------------- real `corun train`


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("fuzz-config") / "run"
    cfg = corun.config_from_dict({
        "run": {"dir": str(run_dir), "steps": 2}, "loop": {"save_interval": 1},
        "log": {"progress": "off"}, "trainer": {"kind": FAKE},
    })  # fmt: skip
    assert anyio.run(corun.run, FakeTrainer(cfg), cfg).reason == "done"
    return run_dir


# (id, text appended to the config's [trainer] table, overrides, places the line names)
SUBPROCESS_CASES = [
    ("wrong-type", '\n[loop]\nconcurrency = "two"\n', [], ["`$.loop.concurrency`"]),
    ("huge-seed", "", ["run.seed=18446744073709551616"], ["`$.run.seed`"]),
    ("deep-nesting", "deep = " + "[" * 5000 + "]" * 5000 + "\n", [], ["nested too deeply"]),
]
IN_PROCESS_CASES = [
    ("nan", "", ["run.teardown_timeout_s=nan"], ["`$.run.teardown_timeout_s`"]),
    ("bad-module-path", "", ["trainer.kind=..x:Y"], ["`$.trainer.kind`", "not a module path"]),
    ("empty-module-path", "", ["trainer.kind=:Y"], ["`$.trainer.kind`", "not a module path"]),
    ("newline-in-key", '"a\\nb" = 1\n', [], ["`$.trainer`", "a\\nb"]),
    ("lane-threads-2**31", "", ["loop.lane_threads=2147483648"], ["`$.loop.lane_threads`"]),
    (
        "workers-10**6",
        "",
        ["loop.concurrency=1000000", "loop.workers=1000000"],
        ["`$.loop.workers`"],
    ),
]


@pytest.mark.parametrize(
    ("extra", "chosen", "places"), [pytest.param(*c[1:], id=c[0]) for c in IN_PROCESS_CASES]
)
def test_found_by_fuzzing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: str, chosen: list[str],
    places: list[str],
) -> None:  # fmt: skip
    """Inputs the fuzzing above found (a traceback, two lines, a hang), kept as examples."""
    count("config/found")
    path = tmp_path / "cfg.toml"
    path.write_text(base_toml(tmp_path / "run") + extra)
    code, _, err = validate(path, capsys, *chosen)
    assert_usage_error(code, err, *places)


@pytest.fixture(scope="module")
def refusals(
    trained: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, tuple[int, str, str]], bool]:
    """Every case as a real ``corun train`` over the trained run directory, side by side;
    and whether the run directory stayed byte for byte as it was."""
    tmp = tmp_path_factory.mktemp("fuzz-config-cases")
    before = tree_hash(trained)
    argvs = []
    for name, extra, chosen, _ in SUBPROCESS_CASES:
        path = tmp / f"{name}.toml"
        path.write_text(base_toml(trained).replace("steps = 2", "steps = 4") + extra)
        argvs.append(["train", str(path), *chosen])
    results = corun_many(tmp, *argvs)
    return dict(zip([c[0] for c in SUBPROCESS_CASES], results, strict=True)), (
        tree_hash(trained) == before
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "places"), [pytest.param(c[0], c[3], id=c[0]) for c in SUBPROCESS_CASES]
)
def test_corun_train_refuses_bad_config(
    refusals: tuple[dict[str, tuple[int, str, str]], bool], name: str, places: list[str]
) -> None:
    count("config/subprocess")
    code, out, err = refusals[0][name]
    assert_usage_error(code, err, *places)
    assert out == ""
    assert refusals[1], "a refused run changed its run directory"
