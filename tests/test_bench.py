"""``corun bench``: the report and plots it writes (on the test's tiny grid, a few
suites), and its one-line usage errors. Figures are never asserted: timings belong in
benchmarks/."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# The fast suites, one of them through real `corun train` processes (ctrl_c).
SUITES = ("async", "endpoint", "ctrl_c")


def corun(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "corun", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


@pytest.mark.slow
def test_bench_writes_report_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    result = corun("bench", ",".join(SUITES), "--quick", "--grid", "tiny", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"corun: bench report: {out / 'report.md'}" in result.stdout
    report = (out / "report.md").read_text()
    assert "| cpus |" in report and "| torch threads |" in report
    assert "load average before" in report and "Load average during" in report
    for suite in SUITES:
        assert f"\n## {suite}\n" in report
    images = re.findall(r"!\[[^]]*\]\(([^)]+\.png)\)", report)
    assert {name.split("-")[0] for name in images} == set(SUITES)
    for name in images:
        assert (out / name).read_bytes().startswith(PNG_MAGIC), name
    assert sorted(p.name for p in out.glob("*.png")) == sorted(images)
    # Every table has a header, a separator and rows, and says what its ratios are against.
    tables = re.findall(r"(\|[^\n]*\|\n\|(?:---\|)+\n(?:\|[^\n]*\|\n)+)", report)
    assert len(tables) >= len(images) + 1  # + the machine's
    assert report.count("Ratio (plot `") == len(images)
    ratios = re.findall(r"\| (\d+\.\d\d) \|", report)  # a ratio column
    assert ratios and all(float(r) > 0 for r in ratios)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "nope"], "unknown suite 'nope'"),
        (["bench", "--grid", "huge"], "invalid choice: 'huge'"),
        (["bench", "--fast"], "unrecognized arguments: --fast"),
    ],
)
def test_bench_bad_arguments_one_line_exit_2(args: list[str], message: str) -> None:
    result = corun(*args, timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr
    assert result.stderr.startswith("corun: error: ")


def test_bench_out_must_be_a_folder(tmp_path: Path) -> None:
    taken = tmp_path / "file"
    taken.write_text("")
    result = corun("bench", "async", "--out", str(taken), timeout=60)
    assert (
        result.returncode == 2
        and result.stderr == f"corun: error: --out {taken}: not a directory\n"
    )


def test_quick_runs_every_suite_but_the_named_slow_ones_and_the_docs_name_them() -> None:
    """`corun bench --quick`'s list: every suite either runs or is left out with why, a
    slow suite named still runs, and the README and docs/benchmarks.md name what is
    left out. Its time is the report's figure ("N s in all"), not asserted here."""
    from benchmarks.suite import NOT_QUICK, SUITES, plan

    run, left_out = plan("all", "quick")
    assert left_out == NOT_QUICK and set(NOT_QUICK) < set(SUITES)
    assert run == [name for name in SUITES if name not in NOT_QUICK]
    assert plan(",".join(NOT_QUICK), "quick") == (list(NOT_QUICK), {})
    assert plan("all", "full") == (list(SUITES), {})
    for name, module in SUITES.items():  # the grid `--quick` picks exists everywhere
        assert "quick" in importlib.import_module(f"benchmarks.{module}").GRIDS, name
    for doc in ("README.md", "docs/benchmarks.md"):
        said = next(line for line in (ROOT / doc).read_text().split("\n\n")
                    if "--quick" in line and "leaves out" in line)  # fmt: skip
        assert all(f"`{name}`" in said for name in NOT_QUICK), (doc, said)


def test_report_names_the_suites_a_quick_run_left_out(tmp_path: Path) -> None:
    from benchmarks.report import write_report

    report = write_report(tmp_path, "quick", {"cpus": 2}, {}, 1.0, {},
                          {"peers": "132 s: TRL"}).read_text()  # fmt: skip
    assert "## Not in --quick" in report and "- peers: 132 s: TRL" in report
    assert "Not in --quick" not in write_report(tmp_path, "full", {}, {}, 1.0, {}).read_text()
