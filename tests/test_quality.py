"""Project-wide rules: ruff and mypy clean on corun/, layering (corun never imports
trainers), and small files."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400


def _python_files(*folders: str) -> list[Path]:
    return [path for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))]


def test_corun_never_imports_trainers() -> None:
    offenders = []
    for path in _python_files("corun"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "trainers"]
    assert offenders == []


def test_trainers_use_only_corun_public_modules() -> None:
    """trainers/ may import corun's documented modules, never private names."""
    offenders = []
    for path in _python_files("trainers"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("corun"):
                offenders += [
                    f"{path.name}: {a.name}" for a in node.names if a.name.startswith("_")
                ]
    assert offenders == []


def test_no_source_file_exceeds_limit() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in _python_files("corun", "trainers", "benchmarks", "tests")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


@pytest.mark.parametrize(
    "command",
    [["ruff", "check", "corun", "trainers", "tests", "benchmarks"], ["mypy"]],
    ids=["ruff", "mypy"],
)
def test_linters_clean(command: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
