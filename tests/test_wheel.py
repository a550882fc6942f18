"""An installed corun is whole: the wheel built from this tree, installed into a fresh
virtual environment, trains a shipped recipe by name (its warm start too) and runs
``corun bench`` from an empty folder, with no checkout on ``sys.path``.

The environment reuses this one's packages (torch, vLLM, ...) through a ``.pth`` file
naming its site-packages, so nothing is downloaded: a path in a ``.pth`` file is not a
site folder, so the ``.pth`` files inside it (this checkout's editable install) are
not run, and corun and trainers come from the wheel alone.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.suite import SUITES

ROOT = Path(__file__).resolve().parents[1]
# What the wheel is built from (corun/recipes/configs links to configs/: copied as files).
SOURCES = ("pyproject.toml", "README.md", "corun", "trainers", "benchmarks", "configs")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.slow  # a build, an install and real runs: minutes


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin folder of a fresh environment with only the wheel of this tree in it."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"  # a copy: the build leaves build/ and *.egg-info beside it
    source.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, source / name, **_no_caches(ROOT / name))
    pip = [sys.executable, "-m", "pip"]
    _check([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
            "-w", str(root / "dist"), str(source)])  # fmt: skip
    (wheel,) = (root / "dist").glob("corun-*.whl")
    _check([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")])
    (purelib,) = (root / "venv" / "lib").glob("python3*/site-packages")
    (purelib / "outer_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _check([*pip, "--python", str(root / "venv" / "bin" / "python"), "install", "--no-deps",
            "--no-index", "-q", str(wheel)])  # fmt: skip
    return root / "venv" / "bin"


def _no_caches(path: Path) -> dict[str, object]:
    return {"ignore": shutil.ignore_patterns("__pycache__", "*.pyc")} if path.is_dir() else {}


def _check(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]


def corun(venv: Path, cwd: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """The installed ``corun`` in ``cwd``, nothing of the checkout's in reach."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"WANDB_MODE": "disabled"}
    return subprocess.run([str(venv / "corun"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)  # fmt: skip


def test_the_wheel_trains_a_recipe_and_benches(venv: Path, tmp_path: Path) -> None:
    code = "import benchmarks, corun, trainers; print(benchmarks, corun, trainers, sep='\\n')"
    where = subprocess.run([str(venv / "python"), "-c", code], cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    paths = [line.split(" from ")[1].strip("'>") for line in where.splitlines()]
    assert len(paths) == 3 and all(Path(p).is_relative_to(venv.parent) for p in paths), where
    listed = corun(venv, tmp_path, "recipes", timeout=60)
    assert listed.returncode == 0, listed.stderr
    recipes = sorted(path.stem for path in (ROOT / "configs").glob("*.toml"))
    assert [line.split()[0] for line in listed.stdout.splitlines()] == recipes
    # The grpo recipe names its warm start by recipe name: trained first, here.
    trained = corun(venv, tmp_path, "train", "grpo", "run.steps=2", "log.progress=off",
                    timeout=600)  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    for run in ("grpo", "sft-warmup"):
        assert '"reason":"done"' in (tmp_path / "runs" / run / "events.jsonl").read_text()
    # A suite that trains a recipe in a fresh `python -m benchmarks.host_lag`.
    out = tmp_path / "bench"
    bench = corun(venv, tmp_path, "bench", "host_lag", "--quick", "--out", str(out), timeout=600)
    assert bench.returncode == 0, bench.stderr[-3000:]
    assert "\n## host_lag\n" in (out / "report.md").read_text()
    assert (out / "host_lag-lag.png").read_bytes().startswith(PNG_MAGIC)


# Each suite runs once in CI. These run from source (the test file named runs the module
# with --quick or its test grid): from the wheel their modules are imported. The others
# run here, from the wheel, at the test grid.
RUN_FROM_SOURCE = {
    "overhead": "test_benchmarks.py",
    "async": "test_benchmarks.py",
    "host_lag": "test_host_lag.py",  # and from the wheel, above
    "endpoint_hf": "test_benchmarks.py",
    "engines": "test_benchmarks.py",
    "parallel": "test_benchmarks.py",
    "tinker": "test_benchmarks.py",
    "peers": "test_benchmarks.py",
}


def test_the_suites_said_to_run_from_source_do() -> None:
    for name, test_file in RUN_FROM_SOURCE.items():
        source = (ROOT / "tests" / test_file).read_text()
        module = SUITES[name]
        assert f'"benchmarks.{module}"' in source or f'_quick_benchmark("{module}"' in source or (
            f'"bench", "{name}"' in source
        ), f"{test_file} does not run the {name} suite"


def test_the_wheel_runs_every_suite(venv: Path, tmp_path: Path) -> None:
    """``corun bench`` from the wheel: the suites no other test runs, each at the test
    grid; the modules of those of :data:`RUN_FROM_SOURCE` imported from it (with the
    peer job's, which ``corun bench peers`` starts as ``python -m``)."""
    modules = [f"benchmarks.{SUITES[name]}" for name in RUN_FROM_SOURCE] + ["benchmarks.peers_job"]
    imported = subprocess.run([str(venv / "python"), "-c", f"import {', '.join(modules)}"],
                              cwd=tmp_path, capture_output=True, text=True)  # fmt: skip
    assert imported.returncode == 0, imported.stderr[-3000:]
    out = tmp_path / "bench"
    names = ",".join(name for name in SUITES if name not in RUN_FROM_SOURCE)
    bench = corun(venv, tmp_path, "bench", names, "--quick", "--grid", "tiny", "--out", str(out),
                  timeout=1800)  # fmt: skip
    assert bench.returncode == 0, bench.stderr[-3000:]
    report = (out / "report.md").read_text()
    assert "**failed**" not in report
    for suite in SUITES:
        assert (f"\n## {suite}\n" in report) is (suite not in RUN_FROM_SOURCE), suite
