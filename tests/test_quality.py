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


def _corun_imports(path: Path) -> set[str]:
    """The corun modules ``path`` imports, anywhere in it (function-local ones too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("corun.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("corun"):
            if node.module == "corun":  # `from corun import checkpoint`: submodules
                found |= {f"corun.{alias.name}" for alias in node.names}
            else:
                found.add(node.module)
    return found


def test_corun_has_no_import_cycles() -> None:
    modules = {f"corun.{p.stem}": p for p in _python_files("corun") if p.stem != "__init__"}
    graph = {name: _corun_imports(path) & modules.keys() for name, path in modules.items()}
    cycles = []

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            cycles.append(" -> ".join([*trail[trail.index(name) :], name]))
            return
        for imported in sorted(graph[name]):
            visit(imported, [*trail, name])

    for name in sorted(graph):
        visit(name, [])
    assert cycles == []


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
    [
        ["ruff", "check", "corun", "trainers", "tests", "benchmarks"],
        ["mypy"],  # corun/, trainers/ and benchmarks/ (pyproject.toml)
        ["mypy", "--strict", "-p", "corun"],
    ],
    ids=["ruff", "mypy", "mypy-strict-corun"],
)
def test_linters_clean(command: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
